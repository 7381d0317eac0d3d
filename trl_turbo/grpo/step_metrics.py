"""The per-micro-step metrics of trl_turbo's features, and the rollout sanity alarm's reading of TRL's metrics.

Design: the training-step seam (`patches/trl_step_metrics.py`) hands this module the trainer and TRL's metric lists;
everything here is feature logic. Each value is all-gathered over the ranks in one collective, as TRL's own metrics
are, so rank 0 logs the run, not itself: traffic and times are averaged, peaks and stalls take the maximum. Every rank
reaches the same gathers in the same order (which metrics exist depends only on the config and the device type,
identical on all ranks).

The rollout alarm (`grpo.rollout_check`) reads the sampler/trainer log-prob gap TRL (or trl_turbo's loss) appended to
TRL's metrics, already averaged over ranks, so every rank warns or raises alike. TRL clears its lists when it logs;
the watch notices a new list and reads each gap once.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ..config import RolloutCheckMode, Settings
from ..offload import optimizer_states
from ..offload.install import runtime_of
from ..offload.memory_plan import MemoryPlanner, describe_plan, plan_metrics
from ..vllm.engine_plan import drain_metrics
from .rollout_check import RolloutCheck, RolloutMismatch

GAP_METRIC = "sampling/sampling_logp_difference/mean"

_GIB = 2**30
# Reduced over ranks by their maximum; every other metric by its mean.
MAXIMUM = frozenset({"offload/host_peak_gib", "offload/host_pool_gib", "offload/blocking_fetches",
                     "offload/optimizer_step_s", "offload/optimizer_states_host_gib",
                     "memory/device_peak_gib/max", "memory/reserved_peak_gib", "memory_plan/predicted_peak_gib",
                     "memory_plan/allocated_gib",
                     "memory_plan/layer_activation_gib"})


def reduced_over_ranks(accelerator: Any, values: dict[str, float],
                       maximum: frozenset[str] = MAXIMUM) -> dict[str, float]:
    """`values` gathered over the ranks in one collective: mean per name, maximum for names in `maximum`."""
    if not values:
        return {}
    names = sorted(values)
    row = torch.tensor([[float(values[name]) for name in names]], dtype=torch.float64, device=accelerator.device)
    gathered = accelerator.gather(row).reshape(-1, len(names))
    return {name: (gathered[:, i].max() if name in maximum else gathered[:, i].mean()).item()
            for i, name in enumerate(names)}


def step_values(trainer: Any) -> dict[str, float]:
    """This rank's metrics for the micro-step that just ended."""
    values: dict[str, float] = {}
    runtime = runtime_of(trainer.model)
    if runtime is not None and runtime.offloader is not None:
        stats = runtime.offloader.take_stats()
        values.update({
            "offload/offloaded_gib": stats.offloaded_bytes / _GIB,
            "offload/kept_on_device_gib": stats.kept_on_device_bytes / _GIB,
            "offload/host_peak_gib": stats.host_bytes_peak / _GIB,
            "offload/host_pool_gib": runtime.offloader.pool.allocated_bytes / _GIB,
            "offload/copy_wait_s": stats.wait_s,
            "offload/blocking_fetches": float(stats.blocking_fetches),
        })
    device = trainer.accelerator.device
    peak_bytes = None
    if device.type == "cuda":
        # The peak since the last reset: this step's, or its training phase's when the step generated with
        # trl_turbo's vLLM engine (which resets at the end of generation and reports its own memory).
        peak_bytes = torch.cuda.max_memory_allocated(device)
        values["memory/reserved_peak_gib"] = torch.cuda.max_memory_reserved(device) / _GIB  # with torch's cache
        torch.cuda.reset_peak_memory_stats(device)
        values["memory/device_peak_gib/mean"] = values["memory/device_peak_gib/max"] = peak_bytes / _GIB
    if runtime is not None and runtime.planner is not None:
        values.update(memory_plan_values(trainer, runtime.planner, peak_bytes))
    states = optimizer_states.installed(getattr(trainer, "optimizer", None))
    if states is not None:
        values.update(states.take_metrics())
    generation = getattr(trainer, "vllm_generation", None)
    if generation is not None:
        values.update(drain_metrics(generation))
    return values


def memory_plan_values(trainer: Any, planner: MemoryPlanner, peak_bytes: int | None) -> dict[str, float]:
    """The micro-step's memory plan as metrics; a peak above its prediction re-plans later micro-batches (and warns
    once). The first plan is printed once."""
    plans = planner.take_step_plans()
    if plans and not trainer.__dict__.get("_trl_turbo_plan_printed"):
        trainer._trl_turbo_plan_printed = True
        if trainer.accelerator.is_main_process:
            print(describe_plan(plans[0]), flush=True)
    message = planner.observe_peak(plans, peak_bytes) if peak_bytes is not None else None
    if message is not None:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    values = plan_metrics(plans)
    ceiling = planner.ceiling() if planner.ceiling is not None else None
    if ceiling is not None:  # the device memory in use the training phase may grow to (standby or the user's)
        values["memory_plan/ceiling_gib"] = ceiling / _GIB
    return values


class _RolloutWatch:
    """The alarm of one trainer and how far into TRL's current gap list it has read."""

    def __init__(self) -> None:
        self.check = RolloutCheck()
        self.values: list[float] | None = None
        self.read = 0


def check_rollout(trainer: Any, logged: Mapping[str, list[float]], mode: RolloutCheckMode | None = None) -> None:
    """Feed the gaps logged (in TRL's training metrics, `logged`) since the last call to the trainer's alarm; warn or
    raise once when it trips. `mode`: the run plan's (default: the trainer's `turbo_rollout_check` as set)."""
    mode = Settings.of(trainer.args).rollout_check if mode is None else mode
    if mode is RolloutCheckMode.OFF:
        return
    values = logged.get(GAP_METRIC)
    if not values:
        return
    watch = trainer.__dict__.setdefault("_trl_turbo_rollout", _RolloutWatch())
    if watch.values is not values:
        watch.values, watch.read = values, 0
    new, watch.read = values[watch.read :], len(values)
    if not new:
        return
    message = watch.check.observe(sum(new) / len(new))
    if message is None:
        return
    if mode is RolloutCheckMode.ERROR:
        raise RolloutMismatch(message)
    warnings.warn(message, RuntimeWarning, stacklevel=2)
