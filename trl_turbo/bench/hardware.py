"""What the GPU can do at best, measured once per benchmark command: its read bandwidth and its bf16 matmul rate.

Design decision: the roofline of a phase (`planning.roofline`) is only as honest as its ceilings, and datasheet
numbers are not what a kernel reaches (an H200's 4.8 TB/s is a peak; a full-device reduction reads at less). So the
ceilings are measured on the machine, by the simplest kernels that reach them: a reduction over a tensor of several
GiB (reads each byte once, writes almost nothing) for bandwidth, and a large square bf16 matmul for FLOP/s, each the
best of several timed repetitions after a warm-up. A benchmark driver measures in a child process of its own
(`measure_apart`): its children's peaks count the whole device, and the driver then holds nothing beyond its CUDA
context while they run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import torch

READ_BYTES = 4 << 30
MATMUL_SIZE = 8192
REPEATS = 10


def _best_seconds(function: Any, device: torch.device, repeats: int = REPEATS) -> float:
    function()  # warm-up: allocation, kernel selection
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(device))
        function()
        end.record(torch.cuda.current_stream(device))
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return best


def _read_seconds(device: torch.device) -> float:
    data = torch.ones(READ_BYTES // 2, dtype=torch.bfloat16, device=device)
    return _best_seconds(lambda: torch.sum(data, dtype=torch.float32), device)


def _matmul_seconds(device: torch.device) -> float:
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, dtype=torch.bfloat16, device=device)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, dtype=torch.bfloat16, device=device)
    return _best_seconds(lambda: a @ b, device)


def measure(device: torch.device) -> dict[str, Any] | None:
    """{"read_bytes_per_s", "bf16_flops_per_s", "how"} of a CUDA device (None elsewhere)."""
    if device.type != "cuda":
        return None
    with torch.cuda.device(device):
        read_s, matmul_s = _read_seconds(device), _matmul_seconds(device)
        torch.cuda.empty_cache()
    return {"read_bytes_per_s": READ_BYTES / read_s, "bf16_flops_per_s": 2 * MATMUL_SIZE**3 / matmul_s,
            "how": f"best of {REPEATS}: a float32-accumulated sum over {READ_BYTES >> 30} GiB of bf16; a bf16 "
                   f"{MATMUL_SIZE}x{MATMUL_SIZE} matmul"}


def measure_apart(device: torch.device) -> dict[str, Any] | None:
    """`measure(device)` in a child process (nothing it allocates stays on the device); None off CUDA."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    result = subprocess.run([sys.executable, "-m", "trl_turbo.bench.hardware", str(index)], capture_output=True,
                            text=True, check=False, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"measuring the GPU's ceilings failed: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(measure(torch.device("cuda", int(sys.argv[1])))))
