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
- A range that cannot be mapped or registered gives None, a failed runtime call's error state cleared (torch checks
  that state after each kernel launch, through the runtime it loaded: `libcudart.so.<major>`); the caller then falls
  back to torch's allocator. The mapping is advised not to be copied into forked children, as the driver's own
  pinned memory is not.
"""

from __future__ import annotations

import ctypes
import mmap
import weakref

import torch


def registered_bytes(nbytes: int) -> torch.Tensor | None:
    """A uint8 CPU tensor of `nbytes`, page-locked by `cudaHostRegister`, or None where that fails (or no CUDA)."""
    import numpy as np

    register = getattr(torch.cuda.cudart(), "cudaHostRegister", None) if torch.cuda.is_available() else None
    if register is None:  # no CUDA, or a build whose runtime bindings lack it (ROCm)
        return None
    try:
        memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # the host refuses the mapping: the caller falls back as for any pinning failure
        return None
    for advice in ("MADV_HUGEPAGE", "MADV_DONTFORK"):
        # huge pages fault in and register faster; a forked child (a data loader's worker) must not get a copy of
        # page-locked memory (the kernel copies DMA-pinned private pages at fork)
        if hasattr(mmap, advice):
            memory.madvise(getattr(mmap, advice))
    array = np.frombuffer(memory, dtype=np.uint8)
    tensor = torch.from_numpy(array)
    tensor.zero_()  # the pages become resident here, outside the driver's call
    if int(register(tensor.data_ptr(), nbytes, 0)) != 0:
        _clear_cuda_error()
        return None
    device = torch.cuda.current_device()
    weakref.finalize(array, _unregister, tensor.data_ptr(), device).atexit = False  # the process's exit frees it all
    return tensor


def _unregister(pointer: int, device: int) -> None:
    """On the device current when the range was registered (the thread dropping the last view may have another
    current device, whose context this would otherwise create)."""
    try:
        with torch.cuda.device(device):
            torch.cuda.synchronize()
            if int(torch.cuda.cudart().cudaHostUnregister(pointer)) != 0:
                _clear_cuda_error()
    except Exception:  # noqa: BLE001 - a finalizer has no caller to raise to; the process frees the pages at exit
        pass


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error (left by a failed runtime call torch did not make)."""
    major = (torch.version.cuda or "12").split(".")[0]
    try:
        ctypes.CDLL(f"libcudart.so.{major}").cudaGetLastError()
    except (OSError, AttributeError):  # the loaded runtime has another name: the next launch check reports it
        pass
