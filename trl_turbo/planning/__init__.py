"""`trl_turbo.plan(...)` and `trl-turbo plan`: a GRPO run's memory per phase before any model loads.

Design decision: the forecast reads the run's own GRPOConfig (a YAML file as `trl grpo` takes it, a dict or a
GRPOConfig) without constructing one, so it runs on a laptop without the GPU the config asks for; the trl_turbo
fields are still validated as the real config would. The model is counted on the meta device. Stock TRL's run of the
same config is forecast beside trl_turbo's, and each gets the longest completion that would fit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .model_spec import ModelSpec, load_config, model_spec
from .report import render
from .run import Override, RunForecast, forecast_run, longest_completion

__all__ = ["Plan", "plan"]

_GIB = 2**30
# ModelConfig fields (TRL's `trl grpo` YAML carries them beside GRPOConfig's) the forecast reads.
_MODEL_FIELDS = {"model_name_or_path": None, "use_peft": False, "lora_r": 16, "lora_target_modules": None,
                 "load_in_4bit": False, "use_bnb_nested_quant": False}


@dataclass(frozen=True)
class Plan:
    model: str
    spec: ModelSpec
    quantized_4bit: bool
    turbo: RunForecast
    stock: RunForecast
    turbo_longest: int | None
    stock_longest: int | None
    turbo_min_peak: int  # the peak of the same run with turbo_memory_plan="min"
    args: Any

    def __str__(self) -> str:
        return render(self)


def _grpo_fields(values: dict[str, Any], processes: int = 1) -> tuple[Any, dict[str, Any]]:
    """A namespace with GRPOConfig's defaults overlaid by `values` (GRPOConfig is not constructed: its checks need
    the run's hardware), and the ModelConfig values; unknown names raise ValueError. `processes` > 1: the run is
    TRL's fsdp2.yaml over that many processes of one node (what `accelerate launch` would tell the config)."""
    from trl import GRPOConfig

    from ..checks import check_config
    from ..config import TurboFields

    defaults: dict[str, Any] = {}
    for item in (*dataclasses.fields(GRPOConfig), *dataclasses.fields(TurboFields)):
        if item.default is not dataclasses.MISSING:
            defaults[item.name] = item.default
        elif item.default_factory is not dataclasses.MISSING:
            defaults[item.name] = item.default_factory()
    model_values = {name: values.get(name, default) for name, default in _MODEL_FIELDS.items()}
    unknown = sorted(set(values) - set(defaults) - set(_MODEL_FIELDS) - _other_model_fields())
    if unknown:
        raise ValueError(f"trl-turbo plan: unknown config fields {unknown} (not fields of GRPOConfig, ModelConfig or "
                         "`trl grpo`'s script arguments)")
    merged = {**defaults, **{k: v for k, v in values.items() if k in defaults}}
    if merged.get("steps_per_generation") is None:
        merged["steps_per_generation"] = merged.get("gradient_accumulation_steps", 1)
    if processes < 1:
        raise ValueError(f"trl-turbo plan: --processes must be >= 1, got {processes}")
    layout = {} if processes == 1 else {"fsdp": "full_shard", "fsdp_config": {"version": 2}}
    args = types.SimpleNamespace(**{**merged, **layout}, world_size=processes)
    with _one_node_of(processes):
        check_config(args, installed=False)
    return args, model_values


@contextlib.contextmanager
def _one_node_of(processes: int) -> Iterator[None]:
    """The launcher's per-node process count, as `accelerate launch` on one node sets it, for the block."""
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(processes)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved


def _other_model_fields() -> set[str]:
    """The names `trl grpo`'s YAML may carry besides GRPOConfig's: ModelConfig's and its script arguments'."""
    from trl import ModelConfig, ScriptArguments

    names = {item.name for item in (*dataclasses.fields(ModelConfig), *dataclasses.fields(ScriptArguments))}
    try:
        from trl.scripts.grpo import GRPOScriptArguments
    except ImportError:  # the script's own fields (reward functions) are then not recognised
        return names
    return names | {item.name for item in dataclasses.fields(GRPOScriptArguments)}


def _config_values(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, (str, Path)):
        import yaml

        return dict(yaml.safe_load(Path(config).read_text()) or {})
    if dataclasses.is_dataclass(config):
        return {item.name: getattr(config, item.name) for item in dataclasses.fields(config)}
    raise TypeError(f"config must be a GRPOConfig, a dict or a YAML path, not {type(config).__name__}")


def device_capacity_bytes(gpu_gib: float | None) -> int:
    """`gpu_gib` when given, else the first CUDA device's memory; ValueError on a machine without one."""
    if gpu_gib is not None:
        return int(gpu_gib * _GIB)
    import torch

    if not torch.cuda.is_available():
        raise ValueError("no CUDA device here: pass the GPU's memory (`--gpu-gib 80`, or `gpu_gib=80`)")
    return torch.cuda.get_device_properties(0).total_memory


def plan(config: Any = None, model: str | None = None, *, gpu_gib: float | None = None,
         host_gib: float | None = None, prompt_tokens: int = 256, completion_tokens: int | None = None,
         processes: int = 1, **fields: Any) -> Plan:
    """Forecast a GRPO run's device and host memory per phase and per GPU, for trl_turbo and for stock TRL.

    `config`: a GRPOConfig, a dict or a YAML path (as `trl grpo --config` takes it, ModelConfig fields included);
    `fields` override it. `model`: a bench shape name, a local directory or config.json, or a hub id (default: the
    config's `model_name_or_path`). `gpu_gib`/`host_gib`: the memory to plan for (default: this machine's).
    `processes` > 1: TRL's fsdp2.yaml over that many GPUs of one node (with the config's
    `vllm_tensor_parallel_size`)."""
    from ..host_memory import available_host_bytes

    values = {**_config_values(config), **fields}
    args, model_values = _grpo_fields(values, processes)
    model = model or model_values["model_name_or_path"]
    if not model:
        raise ValueError("trl-turbo plan: name a model (`--model`, or model_name_or_path in the config)")
    lora_r = model_values["lora_r"] if model_values["use_peft"] else None
    targets = model_values["lora_target_modules"] or "all-linear"
    spec = model_spec(load_config(model), lora_r, targets)
    quantized = bool(model_values["load_in_4bit"])
    capacity = device_capacity_bytes(gpu_gib)
    host = int(host_gib * _GIB) if host_gib is not None else available_host_bytes()
    common = dict(capacity_bytes=capacity, host_capacity_bytes=host, quantized_4bit=quantized,
                  nested_4bit=bool(model_values["use_bnb_nested_quant"]), prompt_tokens=prompt_tokens)
    return Plan(
        model=model, spec=spec, quantized_4bit=quantized,
        turbo=forecast_run(args, spec, completion_tokens=completion_tokens, **common),
        stock=forecast_run(args, spec, completion_tokens=completion_tokens, stock=True, **common),
        turbo_longest=longest_completion(args, spec, **common),
        stock_longest=longest_completion(args, spec, stock=True, **common),
        turbo_min_peak=forecast_run(Override(args, turbo_memory_plan="min"), spec,
                                    completion_tokens=completion_tokens, **common).peak_bytes,
        args=args,
    )
