"""`turbo_expandable_segments`: the allocator setting is turned on (the variable vLLM reads, and the running
allocator where CUDA has started) before TRL's constructor of a trainer with the field, never over the user's own
allocator settings (`PYTORCH_CUDA_ALLOC_CONF`, else `PYTORCH_ALLOC_CONF`), refused against a contrary one, and taken
back by `unpatch()` unless the user has set the variable since."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import trl_turbo
from trl_turbo.offload import expandable_segments
from trl_turbo.patches import trl_trainer_init
from trl_turbo.testing import parity
from trl_turbo.testing.models import tiny_model
from trl_turbo.testing.tokenizer import VOCAB

ENV, GENERIC_ENV = expandable_segments.ENV, expandable_segments.GENERIC_ENV


@pytest.fixture(autouse=True)
def _fresh_patch_state(monkeypatch):
    """Undone before `monkeypatch` puts the environment back (it was set up first), so unpatch() sees the test's."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(GENERIC_ENV, raising=False)
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
def test_the_users_word_is_read_from_the_settings(conf, said):
    assert expandable_segments.configured(conf) is said


def test_a_value_pytorch_does_not_take_is_named():
    with pytest.raises(ValueError, match="expandable_segments:true` .* neither True nor False"):
        expandable_segments.configured("expandable_segments:true")


def test_enabling_sets_the_variable_and_the_running_allocator_then_unpatch_puts_both_back(monkeypatch, allocator):
    monkeypatch.setenv(ENV, "max_split_size_mb:256")
    assert expandable_segments.enable()
    assert os.environ[ENV] == "max_split_size_mb:256,expandable_segments:True"
    assert allocator == ["expandable_segments:True"]
    assert not expandable_segments.enable()  # once on, nothing more to do
    trl_turbo.unpatch()
    assert os.environ[ENV] == "max_split_size_mb:256" and allocator[-1] == "expandable_segments:False"


def test_the_generic_settings_are_kept_in_the_cuda_variable_which_vllm_reads(monkeypatch, allocator):
    monkeypatch.setenv(GENERIC_ENV, "max_split_size_mb:64")
    assert expandable_segments.enable()
    assert os.environ[ENV] == "max_split_size_mb:64,expandable_segments:True"  # it takes precedence over the generic
    trl_turbo.unpatch()
    assert ENV not in os.environ and os.environ[GENERIC_ENV] == "max_split_size_mb:64"
    monkeypatch.setenv(GENERIC_ENV, "expandable_segments:True")
    assert not expandable_segments.enable()


def test_before_cuda_starts_only_the_variable_is_set(monkeypatch, allocator):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert expandable_segments.enable()
    assert allocator == []
    trl_turbo.unpatch()
    assert ENV not in os.environ


def test_a_value_the_user_set_since_stands_through_unpatch(monkeypatch, allocator):
    assert expandable_segments.enable()
    monkeypatch.setenv(ENV, "max_split_size_mb:32")  # the user's, after the first trainer
    assert expandable_segments.enable()  # a later trainer adds the setting to it
    trl_turbo.unpatch()  # the later one's restore, then the first's, which finds the variable not its own
    assert os.environ[ENV] == "max_split_size_mb:32"


def test_the_users_setting_stands_and_a_contrary_one_is_refused_at_config_time(monkeypatch, allocator, tmp_path):
    from trl import GRPOConfig

    monkeypatch.setenv(ENV, "expandable_segments:True")
    assert not expandable_segments.enable() and allocator == []
    for name in (ENV, GENERIC_ENV):
        monkeypatch.delenv(ENV, raising=False)
        monkeypatch.setenv(name, "expandable_segments:False")
        with pytest.raises(ValueError, match=f"{name}='expandable_segments:False' turns expandable segments off"):
            GRPOConfig(**parity.base_config_kwargs(str(tmp_path), turbo_expandable_segments=True))
        GRPOConfig(**parity.base_config_kwargs(str(tmp_path)))  # the field off: the user's setting is theirs


@pytest.mark.parametrize("field", [True, False])
def test_a_trainer_with_the_field_turns_them_on_before_trls_constructor(monkeypatch, allocator, tmp_path, field):
    from trl import GRPOConfig, GRPOTrainer

    from trl_turbo.tasks import arithmetic
    from trl_turbo.testing.tokenizer import build_tokenizer

    seen = []
    constructing = trl_trainer_init.constructing

    @contextlib.contextmanager
    def watched(progress):
        seen.append(expandable_segments.configured())  # as TRL's constructor starts
        with constructing(progress):
            yield

    monkeypatch.setattr(trl_trainer_init, "constructing", watched)
    args = GRPOConfig(**parity.base_config_kwargs(str(tmp_path), turbo_expandable_segments=field))
    GRPOTrainer(model=tiny_model("llama", vocab_size=len(VOCAB)), reward_funcs=[arithmetic.format_reward], args=args,
                processing_class=build_tokenizer(), train_dataset=arithmetic.load_dataset("train").select(range(8)))
    assert seen == [True if field else None]
    assert allocator == (["expandable_segments:True"] if field else [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_segments_made_after_enabling_expand_and_those_after_unpatch_do_not():
    def new_segment_expands() -> set[bool]:
        torch.cuda.empty_cache()  # no cached block to serve it: the allocation makes a segment
        held = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        kinds = {segment["is_expandable"] for segment in torch.cuda.memory_snapshot()
                 if segment["address"] <= held.data_ptr() < segment["address"] + segment["total_size"]}
        del held
        return kinds

    torch.cuda.init()
    if new_segment_expands() != {False}:
        pytest.skip("this process's allocator expands its segments already")
    assert expandable_segments.enable()  # CUDA has started: the running allocator's setting
    assert new_segment_expands() == {True}
    trl_turbo.unpatch()
    assert new_segment_expands() == {False}
    torch.cuda.empty_cache()
