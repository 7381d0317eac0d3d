"""The device memory a run may still take: one reading shared by the memory planner and vLLM's KV budget, and the
cap a benchmark puts on a process to stand in for a smaller GPU.

Design decision: a cap is torch's per-process memory fraction, because every device allocation of a colocated run
goes through torch's caching allocator (training tensors, vLLM's weights, KV cache and CUDA graphs, whose sleep-mode
pools are torch memory pools), so torch refuses whatever would cross it. The CUDA context and kernel images are the
driver's, outside the fraction: `cap_process_memory` measures them once and leaves them out of the fraction, with a
reserve for what the driver loads later (kernels loaded lazily: 0.19 GiB in the 5 GiB Qwen2.5-1.5B row), so the
driver's count of the process stays within the cap.
Everything that sizes itself from free memory reads `device_budget`, which honours the fraction, so
a capped run plans as it would on the smaller GPU.
Memory unmapped behind torch's back (standby's KV cache: torch still counts the tensor, the device no longer holds
it) is lent to torch's fraction while it is unmapped (`lend_unmapped`), so a cap limits what the device holds, as a
smaller GPU would, not what torch's books say.
"""

from __future__ import annotations

import torch

_GIB = 2**30
# Kernel images the driver loads after the cap is set (cuBLAS, Triton, vLLM's kernels), outside torch's fraction:
# measured 0.19 GiB in a whole Qwen2.5-1.5B GRPO step with colocated vLLM (H200, torch 2.11).
LAZY_KERNEL_BYTES = 256 * 2**20


def indexed(device: torch.device | str) -> torch.device:
    """`device` with its index: "cuda" (accelerate's device in a single process) is the current CUDA device, which a
    tensor's `.device` always names with its index."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _index(device: torch.device | str) -> int:
    return indexed(device).index  # torch reads the fraction of an indexed device only


def _fraction(device: torch.device | str) -> float:
    if not torch.cuda.is_initialized():
        return 1.0
    return torch.cuda.get_per_process_memory_fraction(_index(device))


def kept_free_bytes(total_bytes: int, fraction: float, floor_bytes: int, floor_max_fraction: float = 0.10) -> int:
    """A margin a plan keeps free on a device of `total_bytes`: `fraction` of it, and at least `floor_bytes` or
    `floor_max_fraction` of it, the smaller (a fixed floor would keep a large share of a small device back)."""
    return max(int(fraction * total_bytes), min(floor_bytes, int(floor_max_fraction * total_bytes)))


def device_budget(device: torch.device, ceiling_bytes: int | None = None) -> tuple[int, int, int]:
    """(free bytes a plan may count on, bytes torch has allocated, capacity) of a CUDA device: the driver's free
    memory plus torch's cached blocks that hold nothing, within torch's per-process memory fraction and, if given, a
    ceiling on the device memory in use (`ceiling_bytes`: what the generation phase used). The capacity is the
    device's memory, or the part the fraction allows."""
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    reserved = torch.cuda.memory_reserved(device)
    cached_unused = reserved - allocated
    capacity = total
    growth = free
    fraction = _fraction(device)
    if fraction < 1.0:  # torch refuses to reserve beyond it (a capped run)
        capacity = int(fraction * total)
        growth = min(growth, max(0, capacity - reserved))
    if ceiling_bytes is not None:
        growth = min(growth, max(0, ceiling_bytes - (total - free)))
    return growth + cached_unused, allocated, capacity


def cap_process_memory(cap_bytes: int, device: torch.device, others_bytes: int = 0,
                       lazy_bytes: int = LAZY_KERNEL_BYTES) -> dict[str, float]:
    """Limit this process to `cap_bytes` of `device` as the driver counts it (call it before anything allocates):
    the driver's own share (CUDA context, loaded kernels) is measured and the rest becomes torch's per-process
    fraction, less `lazy_bytes` kept for kernels the driver loads later. `others_bytes`: what other processes held on
    the device just before this one started (the driver's free memory is the device's, not the process's). Returns
    the cap, the driver's share measured, the reserve and the fraction set; ValueError when the cap leaves torch
    nothing."""
    torch.cuda.init()
    torch.zeros(1, device=device)  # the context and the allocator exist: their share is in the driver's count
    free, total = torch.cuda.mem_get_info(device)
    driver_share = max(0, (total - free) - torch.cuda.memory_reserved(device) - others_bytes)
    if cap_bytes <= driver_share + lazy_bytes:
        raise ValueError(f"a cap of {cap_bytes / _GIB:.2f} GiB leaves nothing beside the CUDA context "
                         f"({driver_share / _GIB:.2f} GiB) and the kernels loaded later ({lazy_bytes / _GIB:.2f} GiB)")
    fraction = (cap_bytes - driver_share - lazy_bytes) / total
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return {"cap_gib": cap_bytes / _GIB, "driver_share_gib": driver_share / _GIB, "others_gib": others_bytes / _GIB,
            "lazy_reserve_gib": lazy_bytes / _GIB, "memory_fraction": fraction}


def lend_unmapped(unmapped_bytes: int, device: torch.device | str = "cuda") -> float | None:
    """Under a per-process fraction, let torch allocate `unmapped_bytes` more: memory its books still count but the
    device no longer holds (just unmapped). Returns the fraction to restore with `recall_unmapped` (None: no cap)."""
    fraction = _fraction(device)
    if fraction >= 1.0 or unmapped_bytes <= 0:
        return None
    _, total = torch.cuda.mem_get_info(device)
    torch.cuda.set_per_process_memory_fraction(min(1.0, fraction + unmapped_bytes / total), _index(device))
    return fraction


def recall_unmapped(lent: float | None, device: torch.device | str = "cuda") -> None:
    """Before mapping the lent memory back: hand torch's unused cached blocks to the device and restore the
    fraction `lend_unmapped` returned."""
    if lent is None:
        return
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(lent, _index(device))
