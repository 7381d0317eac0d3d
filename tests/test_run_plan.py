"""The run plan: one typed reading of the fields, and the same decisions for a forecast and a run."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from trl_turbo import run_plan
from trl_turbo.config import TURBO_FIELDS, MemoryPlanMode, SamplingMode, Settings
from trl_turbo.planning.model_spec import model_spec
from trl_turbo.planning.run import spec_engine_facts
from trl_turbo.planning.shapes import SHAPES, build_config
from trl_turbo.vllm.engine_plan import engine_facts, plan_engine

HOST = 512 * 2**30


def test_settings_read_every_field_once_with_the_declared_defaults():
    assert [f.name for f in dataclasses.fields(Settings)] == [f.name.removeprefix("turbo_") for f in TURBO_FIELDS]
    defaults = Settings.of(object())  # a config without the fields (built before the import)
    for item in TURBO_FIELDS:
        assert getattr(defaults, item.name.removeprefix("turbo_")) == item.default, item.name
    assert Settings.of(types.SimpleNamespace(turbo_memory_plan="min")).memory_plan is MemoryPlanMode.MIN
    with pytest.raises(ValueError, match=r"`turbo_vllm_sampling='fast'` is not one of auto, merged, fp8, lora"):
        Settings.of(types.SimpleNamespace(turbo_vllm_sampling="fast"))


def _meta_peft_model(shape: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_config(shape), dtype=torch.bfloat16)
    return get_peft_model(model, LoraConfig(r=16, target_modules="all-linear"))


ENGINE_CASES = {
    "merged": {"turbo_vllm_shared_weights": True, "turbo_vllm_standby": True},
    "lora": {"turbo_vllm_shared_weights": True, "turbo_vllm_sampling": "lora"},
    "fp8": {"turbo_vllm_shared_weights": True, "turbo_vllm_standby": True, "turbo_vllm_sampling": "fp8",
            "turbo_vllm_kv_cache_dtype": "fp8"},
}


@pytest.mark.parametrize("shape", sorted(s for s in SHAPES if s != "tiny"))
def test_a_forecast_decides_the_engine_as_the_loaded_model_does(shape):
    """The forecast's engine facts come from the counted config; the run's from the loaded PEFT model (here on the
    meta device): for every bench shape and engine variant the two plans are the same."""
    model = _meta_peft_model(shape)
    loaded = engine_facts(model, host_bytes=HOST)
    counted = spec_engine_facts(model_spec(build_config(shape), 16, "all-linear"), quantized_4bit=False,
                                nested_4bit=True, host_capacity_bytes=HOST)
    assert counted == dataclasses.replace(loaded, merge_problems=counted.merge_problems)
    for case, fields in ENGINE_CASES.items():
        settings = Settings.of(types.SimpleNamespace(**fields))
        assert plan_engine(settings, counted) == plan_engine(settings, loaded), (shape, case)
    tied = "merging would change all" in " ".join(loaded.merge_problems)
    assert not tied and plan_engine(Settings.of(types.SimpleNamespace(**ENGINE_CASES["merged"])),
                                    loaded).sampling is SamplingMode.MERGED


def test_a_trainer_resolves_the_plan_the_forecast_reports(tmp_path):
    """A CPU-built trainer's memory policy and settings are those `run_plan.forecast` gives for its config."""
    from trl_turbo.testing import parity

    for fields in ({}, {"turbo_memory_plan": "min"}, {"turbo_memory_plan": "off"}, {"turbo_tiled_mlp": False},
                   {"turbo_training_memory_gib": 12.0}):
        trainer = parity.build_trainer(parity.base_config_kwargs(str(tmp_path), gradient_checkpointing=True,
                                                                 **fields), peft=True)
        plan = run_plan.of(trainer)
        assert trainer.__dict__[run_plan.PLAN_ATTRIBUTE] is plan
        forecast = run_plan.forecast(trainer.args, engine_facts=None, cuda_device=False)
        assert plan.describe() == forecast.describe(), fields
        assert plan.settings == forecast.settings


def test_no_check_changes_the_config(tmp_path):
    from trl import GRPOConfig

    config = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    before = {item.name: getattr(config, item.name) for item in TURBO_FIELDS}
    from trl_turbo.checks import check_config

    check_config(config)
    assert {item.name: getattr(config, item.name) for item in TURBO_FIELDS} == before
