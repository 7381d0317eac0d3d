"""`turbo_expandable_segments`: the allocator setting is turned on (the variable vLLM reads, and the running
allocator where CUDA has started) when a trainer is constructed with the field, never over the user's own
`PYTORCH_CUDA_ALLOC_CONF`, refused against a contrary one, and put back by `unpatch()`."""

from __future__ import annotations

import os

import pytest
import torch

import trl_turbo
from trl_turbo.offload import expandable_segments
from trl_turbo.testing import parity
from trl_turbo.testing.models import tiny_model
from trl_turbo.testing.tokenizer import VOCAB

ENV = expandable_segments.ENV


@pytest.fixture(autouse=True)
def _fresh_patch_state():
    yield
    trl_turbo.unpatch()
    trl_turbo.patch()


@pytest.fixture
def allocator(monkeypatch):
    """The running allocator's settings as calls, CUDA reported started."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    return calls


@pytest.mark.parametrize(("conf", "said"), [
    ("", None), ("max_split_size_mb:128", None), ("expandable_segments:True", True),
    ("max_split_size_mb:128, expandable_segments:False", False),
    ("expandable_segments:False,expandable_segments:True", True)])  # PyTorch reads the last mention
def test_the_users_word_is_read_from_the_variable(conf, said):
    assert expandable_segments.configured(conf) is said


def test_enabling_sets_the_variable_and_the_running_allocator_then_unpatch_puts_both_back(monkeypatch, allocator):
    monkeypatch.setenv(ENV, "max_split_size_mb:256")
    assert expandable_segments.enable()
    assert expandable_segments.configured() is True
    assert allocator == ["expandable_segments:True"]
    assert not expandable_segments.enable()  # once on, nothing more to do
    trl_turbo.unpatch()
    assert expandable_segments.configured() is None and allocator[-1] == "expandable_segments:False"
    assert os.environ[ENV] == "max_split_size_mb:256"


def test_before_cuda_starts_only_the_variable_is_set(monkeypatch, allocator):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert expandable_segments.enable()
    assert allocator == []
    trl_turbo.unpatch()
    assert ENV not in os.environ


def test_the_users_setting_stands_and_a_contrary_one_is_refused_at_config_time(monkeypatch, allocator, tmp_path):
    from trl import GRPOConfig

    monkeypatch.setenv(ENV, "expandable_segments:True")
    assert not expandable_segments.enable() and allocator == []
    monkeypatch.setenv(ENV, "expandable_segments:False")
    with pytest.raises(ValueError, match="turns expandable segments off"):
        GRPOConfig(**parity.base_config_kwargs(str(tmp_path), turbo_expandable_segments=True))
    GRPOConfig(**parity.base_config_kwargs(str(tmp_path)))  # the field off: the user's setting is theirs


@pytest.mark.parametrize("field", [True, False])
def test_a_trainer_with_the_field_turns_them_on_before_trls_constructor(monkeypatch, allocator, tmp_path, field):
    from trl import GRPOConfig, GRPOTrainer

    from trl_turbo.tasks import arithmetic
    from trl_turbo.testing.tokenizer import build_tokenizer

    monkeypatch.delenv(ENV, raising=False)
    args = GRPOConfig(**parity.base_config_kwargs(str(tmp_path), turbo_expandable_segments=field))
    GRPOTrainer(model=tiny_model("llama", vocab_size=len(VOCAB)), reward_funcs=[arithmetic.format_reward], args=args,
                processing_class=build_tokenizer(), train_dataset=arithmetic.load_dataset("train").select(range(8)))
    assert expandable_segments.configured() is (True if field else None)
    assert allocator == (["expandable_segments:True"] if field else [])
