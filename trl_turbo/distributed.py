"""Which multi-process strategy a run trains with, and which trl_turbo features work under it, known before any
model loads.

Design: GRPOConfig's validation has to refuse or switch off features that cannot work with a strategy before a
model loads, and every rank has to decide the same. The strategy is therefore read from exactly what transformers
and accelerate read later, which is the same on every rank: TrainingArguments' `deepspeed` field (and the plugin
transformers builds from it) and the environment that `accelerate launch` sets from its config file
(`ACCELERATE_USE_DEEPSPEED` with `ACCELERATE_DEEPSPEED_ZERO_STAGE` or a DeepSpeed config file, `ACCELERATE_USE_FSDP`
with `FSDP_VERSION`), or TrainingArguments' `fsdp` field. Nothing here imports deepspeed or touches a process group.

What each feature needs is declared once, in `FEATURE_STRATEGIES` (and `VERSION_GATES` where a strategy needs a
newer library); config validation and the checkpointing setup read it.
"""

from __future__ import annotations

import enum
import json
import os
from typing import Any

from packaging.version import Version

from . import versions


class Strategy(str, enum.Enum):
    SINGLE = "single process"
    DDP = "DDP"
    ZERO1 = "DeepSpeed ZeRO-1"
    ZERO2 = "DeepSpeed ZeRO-2"
    ZERO3 = "DeepSpeed ZeRO-3"
    FSDP1 = "FSDP1"
    FSDP2 = "FSDP2"


# Each rank holds every parameter whole, as a plain tensor, between and during forward passes.
WHOLE_PARAMETER_STRATEGIES = frozenset({Strategy.SINGLE, Strategy.DDP, Strategy.ZERO1, Strategy.ZERO2})
ALL_STRATEGIES = frozenset(Strategy)

# The features that replace transformers' gradient checkpointing (on or off together for a strategy).
CHECKPOINTING_FEATURES = ("turbo_offload_checkpoints", "turbo_tiled_mlp")

# Feature → the strategies it works under, and why not under the others (shown in errors and warnings).
FEATURE_STRATEGIES: dict[str, tuple[frozenset[Strategy], str]] = {
    "turbo_offload_checkpoints": (
        WHOLE_PARAMETER_STRATEGIES | {Strategy.FSDP2},
        "trl_turbo's checkpoint function hands each layer's parameter gradients to the outer backward pass, which "
        "needs the parameters whole when the layer is called; ZeRO-3 and FSDP1 gather them only inside the layer",
    ),
    "turbo_tiled_mlp": (
        WHOLE_PARAMETER_STRATEGIES | {Strategy.FSDP2},
        "the tiled MLP's backward pass reuses the MLP's parameters outside the module call, where ZeRO-3 and FSDP1 "
        "have released them",
    ),
    "turbo_vllm_shared_weights": (
        WHOLE_PARAMETER_STRATEGIES | {Strategy.FSDP2},
        "the training model's frozen weights become views of vLLM's weights, whole or tensor-parallel slices; "
        "ZeRO-3 and FSDP1 keep a flat shard of each weight per rank, which is neither",
    ),
    "turbo_offload_optimizer_states": (
        ALL_STRATEGIES - {Strategy.ZERO1, Strategy.ZERO2, Strategy.ZERO3},
        "it moves the states of the torch optimizer the Trainer steps, and DeepSpeed steps its own: set "
        "`offload_optimizer: {device: cpu}` in the DeepSpeed config instead",
    ),
}


# (feature, strategy) → the library version from which the feature works under that strategy, and why.
_FSDP2_LAYER_FORWARD = ("transformers", "5.23", "from transformers 5.23 a decoder layer checkpoints its forward, "
                        "inside FSDP2's hooks, where the layer's parameters are gathered")
VERSION_GATES: dict[tuple[str, Strategy], tuple[str, str, str]] = {
    ("turbo_offload_checkpoints", Strategy.FSDP2): _FSDP2_LAYER_FORWARD,
    ("turbo_tiled_mlp", Strategy.FSDP2): _FSDP2_LAYER_FORWARD,
}


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _zero_stage(args: Any) -> int:
    config: Any = getattr(args, "deepspeed", None) or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if isinstance(config, str) and config and config != "none":
        with open(config) as handle:
            config = json.load(handle)
    if isinstance(config, dict):
        stage = config.get("zero_optimization", {}).get("stage")
        if stage is not None and stage != "auto":
            return int(stage)
    if os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE"):
        return int(os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"])
    plugin = getattr(args, "deepspeed_plugin", None)
    stage = getattr(plugin, "zero_stage", None)
    return int(stage) if stage is not None else 2  # accelerate's default stage


def _fsdp_version(args: Any) -> int:
    if _truthy(os.environ.get("ACCELERATE_USE_FSDP")):
        return int(os.environ.get("FSDP_VERSION", 1))  # accelerate's default when its config names none
    return int((getattr(args, "fsdp_config", None) or {}).get("version", 2))  # transformers' default


def fsdp_offloads_params() -> bool:
    """Whether the launcher's FSDP config moves the parameters to the host (`fsdp_offload_params: true`)."""
    return _truthy(os.environ.get("FSDP_OFFLOAD_PARAMS"))


def detect_strategy(args: Any) -> Strategy:
    """The strategy `args` (TrainingArguments/GRPOConfig after `__post_init__`) will train with."""
    if getattr(args, "deepspeed", None) or getattr(args, "deepspeed_plugin", None) is not None or _truthy(
            os.environ.get("ACCELERATE_USE_DEEPSPEED")):
        stage = _zero_stage(args)
        return Strategy.ZERO3 if stage == 3 else Strategy.ZERO2 if stage == 2 else Strategy.ZERO1  # 0: as 1
    if getattr(args, "fsdp", None) or _truthy(os.environ.get("ACCELERATE_USE_FSDP")):
        return Strategy.FSDP2 if _fsdp_version(args) == 2 else Strategy.FSDP1
    return Strategy.DDP if getattr(args, "world_size", 1) > 1 else Strategy.SINGLE


def unsupported_features(args: Any, features: list[str]) -> dict[str, str]:
    """Of `features` (turbo_* names), those the run's strategy does not support, with the reason."""
    strategy = detect_strategy(args)
    unsupported: dict[str, str] = {}
    for name in features:
        supported, reason = FEATURE_STRATEGIES.get(name, (ALL_STRATEGIES, ""))
        if strategy not in supported:
            unsupported[name] = f"{reason} (this run: {strategy.value})"
        elif (gap := version_gap(name, strategy)) is not None:
            unsupported[name] = f"{gap} (this run: {strategy.value})"
    return unsupported


def version_gap(feature: str, strategy: Strategy) -> str | None:
    """Why `feature` needs a newer library under `strategy` than the one installed, naming the upgrade; None: it
    does not."""
    gate = VERSION_GATES.get((feature, strategy))
    if gate is None:
        return None
    package, minimum, why = gate
    installed = versions.installed_version(package)
    if installed is not None and Version(installed) >= Version(minimum):
        return None
    return f"{why}; this run has {package} {installed or 'not installed'}: `pip install '{package}>={minimum}'`"


def checkpointing_strategies() -> frozenset[Strategy]:
    """The strategies under which trl_turbo's checkpointing features run with the installed libraries."""
    return frozenset(strategy for strategy in Strategy
                     if all(strategy in FEATURE_STRATEGIES[name][0] and version_gap(name, strategy) is None
                            for name in CHECKPOINTING_FEATURES))


def local_process_count() -> int:
    """Training processes on this host (they share its memory): torchrun's LOCAL_WORLD_SIZE, else 1."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
