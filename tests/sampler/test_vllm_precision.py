"""The colocated vLLM engine gets the training precision as its dtype (TRL passes none)."""

from __future__ import annotations

import sys
import types

import pytest

from trl_turbo import versions
from trl_turbo.offload.install import runtime_of
from trl_turbo.patches import construction, trl_trainer_init, trl_vllm


class _FakeGeneration:
    def __init__(self, mode: str, mixed_precision: str) -> None:
        self.mode = mode
        self.accelerator = types.SimpleNamespace(mixed_precision=mixed_precision)


def _original_init_vllm(self):
    """Stands in for TRL's `_init_vllm`: builds the engine from its module's `LLM`, like TRL does."""
    self.llm = sys.modules[__name__].LLM(model="some/model", seed=0)


def _fake_llm(**kwargs):
    return kwargs


@pytest.fixture
def fake_llm(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "LLM", _fake_llm, raising=False)
    monkeypatch.setattr(versions, "installed_version", lambda package: {"vllm": "0.24.0"}.get(package))


@pytest.mark.parametrize("precision,dtype", [("fp16", "float16"), ("bf16", "bfloat16"), ("no", None)])
def test_engine_dtype_follows_training_precision(fake_llm, precision, dtype):
    generation = _FakeGeneration("colocate", precision)
    trl_vllm._wrap_init_vllm(_original_init_vllm)(generation)
    assert generation.llm.get("dtype") == dtype
    assert sys.modules[__name__].LLM is _fake_llm  # restored after the call


def test_server_mode_and_switch_off_leave_trl_alone(fake_llm, monkeypatch):
    generation = _FakeGeneration("server", "fp16")
    trl_vllm._wrap_init_vllm(_original_init_vllm)(generation)
    assert "dtype" not in generation.llm
    config = types.SimpleNamespace(turbo_vllm_match_precision=False)
    monkeypatch.setattr(construction, "constructing_config", lambda: config)
    generation = _FakeGeneration("colocate", "fp16")
    trl_vllm._wrap_init_vllm(_original_init_vllm)(generation)
    assert "dtype" not in generation.llm


def test_vllm_outside_the_tested_range_keeps_trl_dtype_with_a_warning(fake_llm, monkeypatch):
    monkeypatch.setattr(versions, "installed_version", lambda package: {"vllm": "0.40.0"}.get(package))
    generation = _FakeGeneration("colocate", "fp16")
    with pytest.warns(RuntimeWarning, match=r"turbo_vllm_match_precision` is off.*vllm==0.40.0"):
        trl_vllm._wrap_init_vllm(_original_init_vllm)(generation)
    assert "dtype" not in generation.llm


def test_use_vllm_without_vllm_fails_before_the_model_loads(tmp_path, monkeypatch):
    from trl import GRPOConfig, GRPOTrainer

    monkeypatch.setattr(versions, "importable", lambda module: module != "vllm")
    config = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", use_vllm=True)
    with pytest.raises(ValueError, match=r"`use_vllm=True` needs vLLM.*pip install 'trl-turbo\[vllm\]'"):
        GRPOTrainer(model=str(tmp_path / "no-model"), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                    args=config)


def test_config_is_visible_while_the_trainer_is_constructed():
    seen = []

    def trl_init(self, model, reward_funcs, args=None, **kwargs):
        seen.append(construction.constructing_config())

    config = types.SimpleNamespace(gradient_checkpointing=False)
    trainer = types.SimpleNamespace(args=config, model=None)
    trl_trainer_init._wrap_init(trl_init)(trainer, "model", [], args=config)
    assert seen == [config]
    assert construction.constructing_config() is None  # only during the constructor
    assert runtime_of(trainer.model) is None  # nothing to install without checkpointing
