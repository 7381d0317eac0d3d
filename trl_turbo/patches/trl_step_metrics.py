"""GRPOTrainer.training_step: the per-step metrics of trl_turbo's features, reduced across ranks.

Seam: `GRPOTrainer.training_step` is wrapped; after each micro-step the offload statistics, torch's device-memory peak
and the colocated vLLM engine's timings go into TRL's `_metrics["train"]`, which TRL averages over the logging
interval. Each value is first all-gathered over the ranks, as TRL's own metrics are, so rank 0 logs the run, not
itself: traffic and times are averaged, peaks and stalls take the maximum. Every rank reaches the same gathers in
the same order (which metrics exist depends only on the config and the device type, identical on all ranks).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from . import registry

_GIB = 2**30
# Reduced over ranks by their maximum; every other metric by its mean.
_MAXIMUM = frozenset({"offload/host_peak_gib", "offload/blocking_fetches", "memory/device_peak_gib/max"})


def _reduced(accelerator: Any, values: dict[str, float], maximum: frozenset[str]) -> dict[str, float]:
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
    runtime = getattr(trainer, "_trl_turbo_checkpointing", None)
    if runtime is not None and runtime.offloader is not None:
        stats = runtime.offloader.take_stats()
        values.update({
            "offload/offloaded_gib": stats.offloaded_bytes / _GIB,
            "offload/kept_on_device_gib": stats.kept_on_device_bytes / _GIB,
            "offload/host_peak_gib": stats.host_bytes_peak / _GIB,
            "offload/copy_wait_s": stats.wait_s,
            "offload/blocking_fetches": float(stats.blocking_fetches),
        })
    device = trainer.accelerator.device
    if device.type == "cuda":
        # The peak since the last reset: this step's, or its training phase's when the step generated with
        # trl_turbo's vLLM engine (which resets at the end of generation and reports its own memory).
        peak = torch.cuda.max_memory_allocated(device) / _GIB
        torch.cuda.reset_peak_memory_stats(device)
        values["memory/device_peak_gib/mean"] = values["memory/device_peak_gib/max"] = peak
    generation = getattr(trainer, "vllm_generation", None)
    if generation is not None:
        from .trl_vllm import drain_metrics

        values.update(drain_metrics(generation))
    return values


def _wrap_training_step(original):
    @functools.wraps(original)
    def training_step(self, *args, **kwargs):
        loss = original(self, *args, **kwargs)
        for name, value in _reduced(self.accelerator, step_values(self), _MAXIMUM).items():
            self._metrics["train"][name].append(value)
        return loss

    return training_step


def apply() -> None:
    from trl.trainer.grpo_trainer import GRPOTrainer

    registry.set_attr(GRPOTrainer, "training_step", _wrap_training_step(GRPOTrainer.__dict__["training_step"]))
