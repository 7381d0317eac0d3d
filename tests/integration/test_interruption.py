"""A run stopped in the middle of a step (CPU, trl_turbo defaults, LoRA, no vLLM): an exception or a KeyboardInterrupt
raised inside a reward function, the training forward or the backward leaves the process as it found it:
`save_model()` writes the adapter the trainer holds, and a new trainer builds and trains in the same process. The
checks that the base weights are bitwise the originals and that no scoped patch stays in force guard the training
features here; without vLLM nothing writes base weights or installs a scoped patch, so on CPU they cannot catch the
failures they exist for. Those are tested where they can happen: merged sampling's restore on every way out of a
generation in `tests/sampler/test_vllm_merge.py` (CPU), scoped patches in `tests/patches/test_patching.py`, and an
exception inside generation with shared weights, merged or fp8 sampling in the GPU tests of `tests/sampler/`."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from trl_turbo import registry
from trl_turbo.tasks import arithmetic
from trl_turbo.testing import parity

FAIL_AT_STEP = 2


class _Injected(Exception):
    pass


def _trainer(output_dir, reward_funcs=None):
    kwargs = parity.base_config_kwargs(str(output_dir), max_steps=3, gradient_checkpointing=True,
                                       optim="adamw_torch", learning_rate=5e-3)
    torch.manual_seed(0)
    return parity.build_trainer(kwargs, peft=True, reward_funcs=reward_funcs)


def _raise(error: type[BaseException]):
    raise error("injected") if error is not KeyboardInterrupt else KeyboardInterrupt()


def _arm(trainer, point: str, error: type[BaseException]) -> None:
    """Make step `FAIL_AT_STEP` raise `error` at `point`: in the training forward (the embedding's pre-hook, with grad
    enabled, so TRL's no-grad passes are not hit) or in the backward (a LoRA gradient's hook)."""
    state = {"done": False}

    def fire() -> None:
        if trainer.state.global_step + 1 == FAIL_AT_STEP and not state["done"]:
            state["done"] = True
            _raise(error)

    model = trainer.model.get_base_model().model
    if point == "forward":
        model.embed_tokens.register_forward_pre_hook(lambda module, args: fire() if torch.is_grad_enabled() else None)
    elif point == "backward":
        model.layers[0].self_attn.q_proj.lora_A["default"].weight.register_hook(lambda grad: fire())


def _failing_reward(error, trainer_ref):
    def reward(prompts, completions, **kwargs):
        trainer = trainer_ref[0]
        if trainer is not None and trainer.state.global_step + 1 == FAIL_AT_STEP:
            _raise(error)
        return arithmetic.format_reward(prompts=prompts, completions=completions, **kwargs)
    return reward


@pytest.mark.parametrize("error", [_Injected, KeyboardInterrupt])
@pytest.mark.parametrize("point", ["reward", "forward", "backward"])
def test_a_step_interrupted_anywhere_leaves_a_clean_process(tmp_path, point, error):
    trainer_ref = [None]
    rewards = [_failing_reward(error, trainer_ref)] if point == "reward" else None
    trainer = _trainer(tmp_path / "run", rewards)
    trainer_ref[0] = trainer
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    _arm(trainer, point, error)
    with pytest.raises(error):
        trainer.train()
    assert trainer.state.global_step == FAIL_AT_STEP - 1
    assert registry.scoped_patches() == []  # every scoped patch of the step was put back
    for name, parameter in trainer.model.named_parameters():
        if name in base:
            assert torch.equal(parameter, base[name]), name

    trainer.save_model(str(tmp_path / "saved"))
    saved = load_file(str(tmp_path / "saved" / "adapter_model.safetensors"))
    live = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert len(saved) == len(live) > 0
    for name, tensor in saved.items():
        match = [p for n, p in live.items() if n.replace(".default", "") == name]
        assert len(match) == 1 and torch.equal(match[0].detach(), tensor), name

    fresh = _trainer(tmp_path / "fresh")
    fresh.args.max_steps = 1
    fresh.train()
    assert fresh.state.global_step == 1 and all(torch.isfinite(torch.tensor(log["loss"]))
                                                for log in fresh.state.log_history if "loss" in log)
