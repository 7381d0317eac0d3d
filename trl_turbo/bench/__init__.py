"""Benchmarks of trl_turbo against stock TRL: ``python -m trl_turbo.bench {train,loss,e2e,cpu-step,soak,table}``.

Design decision: stock and turbo are measured in ONE process, on the same randomly initialised model and the same
synthetic inputs, by switching the patch state with ``trl_turbo.unpatch()`` / ``trl_turbo.patch()`` between
variants, so that the only difference between two rows is the code path. Nothing is downloaded: model shapes are
config dicts (:mod:`.shapes`) and inputs are random token ids. This module holds the small device helpers that the
benchmarks share; results are written by :mod:`.results`.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import json
from typing import Any

import torch


def fmt(value: float | None, spec: str) -> str:
    """A measurement for the console tables; "-" when there is none (OOM, error, CPU memory)."""
    return "-" if value is None else format(value, spec)


def resolve_device(name: str | None) -> torch.device:
    """``name`` as a device, or CUDA when available and CPU otherwise."""
    from ..device_memory import indexed

    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return indexed(name)


def parse_lengths(text: str) -> list[int]:
    """``"2048,8192"`` -> ``[2048, 8192]``, sorted ascending (an OOM then skips every longer length)."""
    return sorted({int(part) for part in text.split(",") if part.strip()})


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_allocated(device: torch.device) -> int | None:
    """Bytes held by tensors on ``device`` (``None`` off CUDA, where the allocator keeps no statistics)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_allocated(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def free_memory(device: torch.device) -> None:
    """Return what dropped references held (e.g. after an OOM) to the device before the next measurement.

    Only device memory is measured, so on CPU this is a no-op (a full ``gc.collect()`` costs ~0.5 s with TRL loaded).
    """
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def set_patched(enabled: bool) -> None:
    """Switch TRL between trl_turbo's patches (``True``) and stock code (``False``); fail if the switch did not take."""
    trl_turbo = importlib.import_module("trl_turbo")
    if enabled:
        trl_turbo.patch()
    else:
        trl_turbo.unpatch()
    if trl_turbo.is_patched() != enabled:
        switch = "patch" if enabled else "unpatch"
        raise RuntimeError(f"trl_turbo.{switch}() did not take effect (unsupported versions?)")


def parse_turbo_overrides(items: list[str]) -> dict[str, Any]:
    """`--turbo-set FIELD=VALUE` items as GRPOConfig fields (VALUE read as JSON where it parses, else a string);
    SystemExit for a field trl_turbo does not add."""
    from ..config import TurboFields

    known = {f.name for f in dataclasses.fields(TurboFields)}
    overrides: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or name not in known:
            raise SystemExit(f"--turbo-set takes FIELD=VALUE with a trl_turbo field, got {item!r}")
        try:
            overrides[name] = json.loads(text)
        except json.JSONDecodeError:
            overrides[name] = text
    return overrides
