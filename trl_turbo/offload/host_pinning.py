"""Page-locked host memory, registered with CUDA rather than allocated pinned: several times faster to obtain.

Design decisions:
- torch's `pin_memory=True` (cudaHostAlloc) page-locks at about 2.2 GB/s on the lent H200 machine, whatever the
  size asked; writing zeros into plain memory and then registering the range (`cudaHostRegister`) takes 13-17 GB/s
  (`benchmarks/results/pinning-20261129-050141.json`). That is the first step of an offloaded run: 29.9 GiB of an 8B
  model's Adam states took 22.6 s to pin. Copies out of either kind of memory run at the same PCIe speed.
- The memory is a private anonymous mapping of its own (page-aligned, sharing no page with another allocation, which
  a second registration of that page would refuse; private, since a shared one is backed by shmem, whose pages fault
  in about ten times slower), seen through a numpy array as a torch tensor: every view of it
  keeps the array alive, and a finalizer on the array unregisters the range before the mapping goes, after waiting
  for the device (a copy still in flight must never touch freed memory).
- A range that cannot be registered gives None and clears CUDA's error state (torch checks that state after each
  kernel launch); the caller then falls back to torch's allocator.
"""

from __future__ import annotations

import ctypes
import mmap
import weakref

import torch


def registered_bytes(nbytes: int) -> torch.Tensor | None:
    """A uint8 CPU tensor of `nbytes`, page-locked by `cudaHostRegister`, or None where that fails (or no CUDA)."""
    import numpy as np

    if not torch.cuda.is_available():
        return None
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    array = np.frombuffer(memory, dtype=np.uint8)
    tensor = torch.from_numpy(array)
    tensor.zero_()  # the pages become resident here, outside the driver's call
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(tensor.data_ptr(), nbytes, 0)) != 0:
        _clear_cuda_error()
        return None
    weakref.finalize(array, _unregister, tensor.data_ptr())
    return tensor


def _unregister(pointer: int) -> None:
    try:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(pointer)
    except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone, and the process frees the pages anyway
        pass


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error (left by a failed runtime call torch did not make)."""
    major = (torch.version.cuda or "12").split(".")[0]
    try:
        ctypes.CDLL(f"libcudart.so.{major}").cudaGetLastError()
    except (OSError, AttributeError):  # the loaded runtime has another name: the next launch check reports it
        pass
