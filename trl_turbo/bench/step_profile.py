"""Where a training step's time goes on the GPU: each CUDA stream's busy time by kernel class, and how long the stream
that runs the model's GEMMs sat idle, and behind what.

Design decision: under FSDP2 and offloading, kernels of several streams overlap (all-gathers and reduce-scatters on
NCCL's streams, host copies on their own), so summing kernel times says nothing about the step's length. What
lengthens a step is the compute stream waiting: the idle time of the stream with the most GEMM time, within the
step's wall time, and the part of it that other streams' communication or host copies covered (exposed: the compute
stream waited while they ran) against the part nothing on the GPU covered (the host: Python, launches,
synchronisation). One step is profiled (torch's profiler, CUDA activity only) after the warm-up; everything but
`profiled` is pure and tested on CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from . import decode_profile
from .decode_profile import KERNEL_CLASSES

# A training step's own classes first: NCCL's collectives, host copies (offloaded checkpoints, optimizer states),
# the optimizer; then the decode profile's.
TRAIN_KERNEL_CLASSES: tuple[tuple[str, str], ...] = (
    ("communication", r"nccl|all_?gather|reduce_?scatter|all_?reduce"),
    ("host copy", r"memcpy (htod|dtoh)"),
    ("optimizer", r"adam|multi_tensor_apply"),
    *KERNEL_CLASSES,
)
_PATTERNS = decode_profile.compiled_classes(TRAIN_KERNEL_CLASSES)
COMPUTE = "gemm"  # the class that names the compute stream
EXPOSED = ("communication", "host copy")  # the classes whose time on other streams can hold the compute stream back


class Kernel(NamedTuple):
    """One kernel launch as the profiler saw it: name, CUDA stream, start and end (µs)."""

    name: str
    stream: int
    start_us: float
    end_us: float


def classify(kernel: str) -> str:
    """The class of a kernel name in a training step (`decode_profile.OTHER` when none matches)."""
    return decode_profile.classify(kernel, _PATTERNS)


def union_us(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time as `intervals`."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _overlap(first: list[tuple[float, float]], second: list[tuple[float, float]]) -> float:
    """µs that two sorted, disjoint interval lists share."""
    shared, i, j = 0.0, 0, 0
    while i < len(first) and j < len(second):
        shared += max(0.0, min(first[i][1], second[j][1]) - max(first[i][0], second[j][0]))
        if first[i][1] < second[j][1]:
            i += 1
        else:
            j += 1
    return shared


def _gaps(busy: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """The parts of [start, end] that the sorted, disjoint `busy` leaves uncovered."""
    gaps, cursor = [], start
    for busy_start, busy_end in busy:
        if busy_start > cursor:
            gaps.append((cursor, min(busy_start, end)))
        cursor = max(cursor, busy_end)
    if cursor < end:
        gaps.append((cursor, end))
    return [(a, b) for a, b in gaps if b > a]


def summarize_step(kernels: Iterable[Kernel], wall_s: float) -> dict[str, Any]:
    """One profiled step: per stream its busy ms and ms by class; the compute stream (most GEMM time), its idle ms
    within the step's wall time (`wall_s`, taken to end with the last kernel: the step ends by synchronising), and of
    that idle time the ms each of `EXPOSED`'s classes covered on other streams, and the ms nothing covered."""
    kernels = list(kernels)
    if not kernels:
        return {"wall_ms": 1e3 * wall_s, "streams": {}, "compute_stream": None}
    kinds = [classify(kernel.name) for kernel in kernels]
    streams: dict[int, dict[str, Any]] = {}
    for kernel, kind in zip(kernels, kinds):
        entry = streams.setdefault(kernel.stream, {"intervals": [], "classes": {}})
        entry["intervals"].append((kernel.start_us, kernel.end_us))
        entry["classes"][kind] = entry["classes"].get(kind, 0.0) + (kernel.end_us - kernel.start_us)
    compute = max(streams, key=lambda stream: (streams[stream]["classes"].get(COMPUTE, 0.0),
                                               _length(streams[stream]["intervals"])))
    last = max(kernel.end_us for kernel in kernels)
    window_start = min(min(kernel.start_us for kernel in kernels), last - 1e6 * wall_s)
    compute_busy = union_us(streams[compute]["intervals"])
    idle = _gaps(compute_busy, window_start, last)
    covered: dict[str, float] = {}
    for kind in EXPOSED:
        spans = union_us((k.start_us, k.end_us) for k, named in zip(kernels, kinds) if k.stream != compute
                         and named == kind)
        covered[kind] = _overlap(idle, spans) / 1e3
    anything_else = union_us((k.start_us, k.end_us) for k in kernels if k.stream != compute)
    return {
        "wall_ms": 1e3 * wall_s,
        "compute_stream": compute,
        "compute_busy_ms": _length(compute_busy) / 1e3,
        "compute_idle_ms": _length(idle) / 1e3,
        "idle_behind_ms": covered,
        "idle_with_gpu_empty_ms": (_length(idle) - _overlap(idle, anything_else)) / 1e3,
        "streams": {str(stream): {"busy_ms": _length(union_us(entry["intervals"])) / 1e3,
                                  "classes_ms": {kind: us / 1e3 for kind, us in
                                                 sorted(entry["classes"].items(), key=lambda item: -item[1])}}
                    for stream, entry in streams.items()},
    }


def format_step(summary: dict[str, Any]) -> str:
    """One line: the step, the compute stream's busy and idle time, and what its idle time waited behind."""
    if "error" in summary:
        return f"step profile failed: {summary['error']}"
    if summary.get("compute_stream") is None:
        return f"step profile: {summary['wall_ms']:.0f} ms, no kernel recorded"
    behind = ", ".join(f"{kind} {ms:.0f} ms" for kind, ms in summary["idle_behind_ms"].items())
    return (f"step profile: {summary['wall_ms']:.0f} ms; compute stream busy {summary['compute_busy_ms']:.0f} ms, "
            f"idle {summary['compute_idle_ms']:.0f} ms (behind {behind}; GPU empty "
            f"{summary['idle_with_gpu_empty_ms']:.0f} ms)")


def profile_of(row: dict[str, Any]) -> dict[str, Any] | None:
    """The step profile a row's steps carry, if one step was profiled."""
    return next((step["profile"] for step in row.get("steps") or [] if "profile" in step), None)


def kernels_of(profiler: Any) -> list[Kernel]:
    """Every GPU kernel and copy a torch profiler recorded, with its stream and times."""
    found = []
    for event in profiler.events():
        if "cuda" not in str(getattr(event, "device_type", "")).lower():
            continue
        found.append(Kernel(event.name, int(getattr(event, "device_resource_id", 0) or 0),
                            float(event.time_range.start), float(event.time_range.end)))
    return found


@contextlib.contextmanager
def profiled() -> Iterator[list[Kernel]]:
    """Profile the block's CUDA activity; the list it yields is filled with the kernels when the block ends."""
    from torch.profiler import ProfilerActivity, profile

    kernels: list[Kernel] = []
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        yield kernels
    kernels.extend(kernels_of(profiler))
