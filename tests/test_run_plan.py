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
            "turbo_vllm_kv_cache_dtype": "fp8", "vllm_importance_sampling_mode": "token_truncate"},
}


@pytest.mark.parametrize("shape", sorted(s for s in SHAPES if s != "tiny"))
def test_a_forecast_decides_the_engine_as_the_loaded_model_does(shape):
    """The forecast's engine facts come from the counted config; the run's from the loaded PEFT model (here on the
    meta device): for every bench shape and engine variant the two plans are the same."""
    model = _meta_peft_model(shape)
    loaded = engine_facts(model, host_bytes=HOST)
    counted = spec_engine_facts(model_spec(build_config(shape), 16, "all-linear"), quantized_4bit=False,
                                nested_4bit=True, host_capacity_bytes=HOST)
    # a forecast judges for another machine: not by the vLLM installed here
    assert counted == dataclasses.replace(loaded, merge_problems=counted.merge_problems, installed_vllm=False)
    for case, fields in ENGINE_CASES.items():
        settings = Settings.of(types.SimpleNamespace(**fields))
        assert plan_engine(settings, counted) == plan_engine(settings, loaded), (shape, case)
    tied = "merging would change all" in " ".join(loaded.merge_problems)
    assert not tied and plan_engine(Settings.of(types.SimpleNamespace(**ENGINE_CASES["merged"])),
                                    loaded).sampling is SamplingMode.MERGED


def test_a_trainer_resolves_the_plan_the_forecast_reports(tmp_path):
    """A CPU-built trainer's plan is the one `trl-turbo plan` builds from the same config values (read as the
    forecast reads a YAML file, not from the trainer's config object)."""
    from trl_turbo.planning import _grpo_fields
    from trl_turbo.testing import parity

    for fields in ({}, {"turbo_memory_plan": "min"}, {"turbo_memory_plan": "off"}, {"turbo_tiled_mlp": False},
                   {"turbo_training_memory_gib": 12.0}, {"turbo_lean_norms": False, "turbo_forward_token_budget": 64}):
        values = parity.base_config_kwargs(str(tmp_path), gradient_checkpointing=True, **fields)
        trainer = parity.build_trainer(values, peft=True)
        plan = trainer.__dict__[run_plan.PLAN_ATTRIBUTE]
        args, _ = _grpo_fields({k: v for k, v in values.items() if k != "output_dir"})
        forecast = run_plan.forecast(args, engine_facts=None, cuda_device=False)
        assert plan.describe() == forecast.describe(), fields
        assert plan.settings == forecast.settings
        assert plan.memory.mode == fields.get("turbo_memory_plan", "auto")


def test_no_check_changes_the_config(tmp_path, monkeypatch):
    """On a vLLM only checked against its sources, the rollout alarm is raised to 'error' by the plan, not by
    rewriting the config (which the old check did)."""
    import warnings

    from helpers import as_if_vllm_installed
    from trl import GRPOConfig

    from trl_turbo.checks import check_config
    from trl_turbo.vllm_contract import _installed_verdict

    tree = tmp_path / "vllm"
    (tree / "vllm").mkdir(parents=True)
    as_if_vllm_installed(monkeypatch, "0.27.1", tree / "vllm")
    monkeypatch.setattr("trl_turbo.vllm_contract.verdict", lambda version, package: types.SimpleNamespace(
        error=None, notice="vllm==0.27.1 is not GPU-verified", why_unavailable=lambda feature: None))
    _installed_verdict.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", use_vllm=True,
                                vllm_mode="colocate", turbo_vllm_standby=True)
            before = {item.name: getattr(config, item.name) for item in TURBO_FIELDS}
            check_config(config)
        assert {item.name: getattr(config, item.name) for item in TURBO_FIELDS} == before
        assert config.turbo_rollout_check == "warn"
        assert run_plan.rollout_check(Settings.of(config)) == "error"
        assert run_plan.rollout_check(Settings.of(config), installed=False) == "warn"  # a forecast for elsewhere
    finally:
        _installed_verdict.cache_clear()


def test_the_forecast_counts_the_host_copy_merged_sampling_takes_and_falls_back_as_the_run_does():
    """Merged sampling's host copy holds the adapted matrices only (2 bytes each); where it would not fit the host,
    the run samples through LoRA slots, and so does the forecast."""
    from trl_turbo.planning.run import forecast_run

    args = types.SimpleNamespace(use_vllm=True, vllm_mode="colocate", turbo_vllm_shared_weights=True,
                                 turbo_vllm_standby=True, per_device_train_batch_size=8, max_completion_length=1024)
    config = build_config("qwen2.5-1.5b")
    every, some = model_spec(config, 16, "all-linear"), model_spec(config, 16, ["q_proj", "v_proj"])
    assert 0 < some.adapted_parameters < every.adapted_parameters == every.layer_linear_parameters
    for spec in (every, some):
        forecast = forecast_run(args, spec, capacity_bytes=80 * 2**30, host_capacity_bytes=HOST)
        assert forecast.plan.engine.sampling is SamplingMode.MERGED
        generation = next(phase for phase in forecast.phases if phase.name == "generation")
        assert generation.host_bytes == 2 * spec.adapted_parameters
    small = forecast_run(args, every, capacity_bytes=80 * 2**30, host_capacity_bytes=2**30)
    assert small.plan.engine.sampling is SamplingMode.LORA and "host copy" in small.plan.engine.sampling_problems[0]
    assert next(phase for phase in small.phases if phase.name == "generation").host_bytes == 0


def test_ddp_skips_the_unused_parameter_search_only_where_every_adapter_trains():
    """A LoRA run of a listed dense family under DDP: every adapted layer runs in every forward, so DDP's search for
    unused parameters after each backward (transformers asks for it for any PEFT model) is skipped; anything else,
    or a value the user set, is left alone."""
    from peft import LoraConfig

    from trl_turbo.run_plan import every_parameter_trains_each_step
    from trl_turbo.testing.models import tiny_model

    llama = tiny_model("llama", vocab_size=64)

    def config(world_size=2, **fields):
        return types.SimpleNamespace(**{"ddp_find_unused_parameters": None, "world_size": world_size,
                                        "deepspeed": None, "deepspeed_plugin": None, "fsdp": None,
                                        "fsdp_config": None, **fields})

    lora = LoraConfig(r=4, target_modules="all-linear")
    assert not every_parameter_trains_each_step(config(world_size=1), llama, lora)  # one process: no DDP
    assert every_parameter_trains_each_step(config(), llama, lora)
    assert not every_parameter_trains_each_step(config(ddp_find_unused_parameters=True), llama, lora)
    assert not every_parameter_trains_each_step(config(), llama, None)  # full fine-tuning: transformers decides
    assert not every_parameter_trains_each_step(config(), llama, LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    assert not every_parameter_trains_each_step(config(), llama, LoraConfig(r=4, modules_to_save=["lm_head"]))
    gpt2 = types.SimpleNamespace(config=types.SimpleNamespace(model_type="gpt2"))
    assert not every_parameter_trains_each_step(config(), gpt2, lora)  # not a listed family


def test_fsdp2_full_fine_tuning_reduces_gradients_each_micro_batch(monkeypatch):
    """Under FSDP2 a full fine-tuning with gradient accumulation asks accelerate to reduce-scatter after every
    micro-batch (no whole 16-bit gradients held across them); an adapter, one micro-batch, another strategy or a
    value the user set is left alone. The Trainer reads the setting from the config it is given."""
    from accelerate.utils import GradientAccumulationPlugin
    from peft import LoraConfig
    from trl import GRPOConfig

    from trl_turbo.run_plan import reduces_gradients_each_micro_batch
    from trl_turbo.testing.models import tiny_model

    model = tiny_model("llama", vocab_size=64)

    def config(**fields):
        return GRPOConfig(**{"output_dir": "unused", "use_cpu": True, "bf16": False, "gradient_accumulation_steps": 4,
                             **fields})

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert not reduces_gradients_each_micro_batch(config(), model, None)  # one process, no FSDP2
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert reduces_gradients_each_micro_batch(config(), model, None)
    assert not reduces_gradients_each_micro_batch(config(), model, LoraConfig(r=4))
    assert not reduces_gradients_each_micro_batch(config(gradient_accumulation_steps=1), model, None)
    user = config(accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": False}})
    assert not reduces_gradients_each_micro_batch(user, model, None)
    monkeypatch.setenv("FSDP_VERSION", "1")
    assert not reduces_gradients_each_micro_batch(config(), model, None)

    monkeypatch.setenv("FSDP_VERSION", "2")
    import trl

    chosen = config()
    progress = run_plan.begin(trl.GRPOTrainer, chosen, model, None)
    assert progress.reduce_each_micro_batch
    assert chosen.accelerator_config.gradient_accumulation_kwargs is None  # the user's config is left as it was
    # after TRL's constructor: set where the Trainer's loop reads it, on the accelerator the trainer built
    gradient_state = types.SimpleNamespace(plugin_kwargs=GradientAccumulationPlugin(num_steps=1).to_kwargs())
    trainer = types.SimpleNamespace(args=chosen, vllm_generation=None, accelerator=types.SimpleNamespace(
        device=torch.device("cpu"), gradient_state=gradient_state))
    plan = run_plan.finish(progress, trainer)
    assert gradient_state.plugin_kwargs["sync_each_batch"] is True
    assert plan.reduce_each_micro_batch and plan.describe()["reduce_each_micro_batch"]
