"""The host memory available now: one reading shared by checkpoint offload's budget and merged sampling's host copy,
offload's default budget per training process, the floor of available memory offload never pins below, and this
process's resident memory (read by the soak benchmark)."""

from __future__ import annotations

import os

from .distributed import local_process_count

_GIB = 2**30
# Share of the host's available memory checkpoint offload may pin by default, over all training processes of the host
OFFLOAD_HOST_FRACTION = 0.8


# Host memory checkpoint offload leaves available, as a share of the host's total: a pool stops growing below it
OFFLOAD_HOST_FLOOR_FRACTION = 0.05


def _proc_kib_field(path: str, field: str) -> int | None:
    """Bytes of a `field: N kB` line of a Linux /proc file (None: no such file or line)."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); elsewhere the OS's count of available pages."""
    found = _proc_kib_field("/proc/meminfo", "MemAvailable")
    return found if found is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def total_host_bytes() -> int:
    """MemTotal from /proc/meminfo (Linux); elsewhere the OS's count of physical pages."""
    found = _proc_kib_field("/proc/meminfo", "MemTotal")
    return found if found is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def process_rss_bytes() -> int:
    """This process's resident set size, VmRSS from /proc/self/status (Linux; 0 elsewhere)."""
    return _proc_kib_field("/proc/self/status", "VmRSS") or 0


def offload_host_floor_bytes() -> int:
    """The host memory checkpoint offload leaves available: `OFFLOAD_HOST_FLOOR_FRACTION` of the host's total."""
    return int(total_host_bytes() * OFFLOAD_HOST_FLOOR_FRACTION)


def offload_budget_bytes(budget_gib: float | None) -> int:
    """Pinned host memory one training process's checkpoint offload may hold: `turbo_offload_host_budget_gib` when
    set, else its share (one of `local_process_count()`) of `OFFLOAD_HOST_FRACTION` of the host's available memory,
    so the processes of one host together stay within it."""
    if budget_gib is not None:
        return int(budget_gib * _GIB)
    return int(available_host_bytes() * OFFLOAD_HOST_FRACTION / local_process_count())
