"""The host memory available now: one reading shared by checkpoint offload's budget and merged sampling's host copy."""

from __future__ import annotations

import os


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); elsewhere the OS's count of available pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
