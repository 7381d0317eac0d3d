"""How fast the host page-locks memory, by allocation method: what the first step of an offloaded run pays.

Design decision: each method page-locks the same total (`--gib`) and is timed from nothing to memory a CUDA copy
reads without staging, then checked by timing one host-to-device copy out of it (pinned memory copies at PCIe
speed; pageable memory at a fraction of it). torch's `pin_memory=True` (cudaHostAlloc) is timed at the chunk sizes
trl_turbo's pools use and at large slabs; `cudaHostRegister` over memory that several threads faulted in first is
what torch's own `pinned_use_cuda_host_register` allocator option does, and trl_turbo's own `registered_bytes` at an
8B model's state size and at 256 MiB. Every method's memory is given back before the next.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .results import DEFAULT_RESULTS_DIR

MIB = 1 << 20


def _torch_pinned(total: int, piece: int) -> tuple[list[Any], dict[str, float]]:
    import torch

    start = time.perf_counter()
    pieces = [torch.empty(piece, dtype=torch.uint8, pin_memory=True) for _ in range(total // piece)]
    return pieces, {"allocate_s": time.perf_counter() - start}


def _registered(total: int, piece: int, threads: int) -> tuple[list[Any], dict[str, float]]:
    import numpy as np
    import torch

    cudart = torch.cuda.cudart()
    start = time.perf_counter()
    arrays = [np.empty(piece, dtype=np.uint8) for _ in range(total // piece)]
    tensors = [torch.from_numpy(array) for array in arrays]
    stride = max(MIB, piece // threads)

    def touch(job: tuple[int, int]) -> None:
        index, offset = job
        tensors[index][offset : offset + stride].zero_()

    jobs = [(i, offset) for i in range(len(tensors)) for offset in range(0, piece, stride)]
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(touch, jobs))
    touched = time.perf_counter()
    for tensor in tensors:
        code = cudart.cudaHostRegister(tensor.data_ptr(), piece, 0)
        if int(code) != 0:
            raise RuntimeError(f"cudaHostRegister failed: {code}")
    end = time.perf_counter()
    return tensors, {"allocate_s": end - start, "touch_s": touched - start, "register_s": end - touched}


def _library(total: int, piece: int) -> tuple[list[Any], dict[str, float]]:
    """trl_turbo's own method (`offload.host_pinning.registered_bytes`), what its pinned pools allocate with."""
    from ..offload.host_pinning import registered_bytes

    start = time.perf_counter()
    pieces = [registered_bytes(piece) for _ in range(total // piece)]
    if any(piece is None for piece in pieces):
        raise RuntimeError("registered_bytes could not register the memory")
    return pieces, {"allocate_s": time.perf_counter() - start}


def _release(method: str, pieces: list[Any]) -> None:
    import torch

    torch.cuda.synchronize()
    if method.startswith("register"):
        cudart = torch.cuda.cudart()
        for tensor in pieces:
            cudart.cudaHostUnregister(tensor.data_ptr())
    pieces.clear()  # trl_turbo's memory is unregistered as its last view goes
    empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
    if empty_host_cache is not None:
        empty_host_cache()


def _copy_rate(pieces: list[Any], device: Any) -> float:
    """Bytes per second of one host-to-device copy of the first GiB (or less) of `pieces`."""
    import torch

    chosen, nbytes = [], 0
    for piece in pieces:
        if nbytes >= 1 << 30:
            break
        chosen.append(piece)
        nbytes += piece.numel()
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    torch.cuda.synchronize()
    start = time.perf_counter()
    offset = 0
    for piece in chosen:
        target[offset : offset + piece.numel()].copy_(piece, non_blocking=True)
        offset += piece.numel()
    torch.cuda.synchronize()
    return nbytes / (time.perf_counter() - start)


def run(args: argparse.Namespace) -> Path:
    import torch

    from .results import metadata

    if not torch.cuda.is_available():
        raise SystemExit("the pinning benchmark page-locks memory for CUDA copies: it needs a CUDA GPU")
    device = torch.device("cuda", 0)
    total = int(args.gib * (1 << 30))
    methods: list[tuple[str, Any]] = [(f"pin_memory {size} MiB", lambda size=size: _torch_pinned(total, size * MIB))
                                      for size in (4, 16, 256)]
    methods += [(f"register 256 MiB, {threads} threads",
                 lambda threads=threads: _registered(total, 256 * MIB, threads)) for threads in (1, 8)]
    methods += [(f"trl_turbo registered_bytes {size} MiB", lambda size=size: _library(total, size * MIB))
                for size in (112, 256)]
    config = {"gib": args.gib}
    meta = metadata("pinning", device, config)
    torch.empty(1, device=device)  # the CUDA context before any timing
    rows = []
    for name, allocate in methods:
        pieces, times = allocate()
        row = {"method": name, **times, "gb_per_s": total / times["allocate_s"] / 1e9,
               "h2d_gb_per_s": _copy_rate(pieces, device) / 1e9}
        _release(name, pieces)
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"pinning-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("pinning", help="host page-locking speed by allocation method")
    parser.add_argument("--gib", type=float, default=8.0, help="host memory each method page-locks")
    parser.add_argument("--out", default=str(DEFAULT_RESULTS_DIR), help="results folder")
    parser.set_defaults(func=run)
