"""The optimizer's states in pinned host memory between steps, streamed through the device in chunks at each step.

Design decisions:
- What moves is every tensor the optimizer keeps per parameter (Adam's two moments; any optimizer's tensors of more
  than one element on the device), never the parameters or their gradients: a full fine-tuning's 8 bytes per trained
  parameter leave the device for the forward, backward and generation, and the step still runs on the device, with
  the optimizer's own kernels.
- A state keeps its identity: its device storage is resized to nothing and back, with its values in pinned chunks
  of a `PinnedPool` (exact sizes; a pinned tensor of its own would be rounded up to a power of two). States under
  `MIN_STATE_BYTES` (norms, biases) stay on the device. FSDP2's states (DTensors) and plain tensors are moved alike,
  through their local tensors, and the optimizer's `state_dict`/`load_state_dict`, which read and replace the dict,
  keep working (a hook brings the states back first; loaded states are offloaded at the next step).
- A step walks the parameters in chunks of about `chunk_bytes` of states: the optimizer steps one chunk's parameters
  at a time (each parameter group narrowed to them for that call, its hyper-parameters untouched), its states
  fetched just before and sent back just after, all on the current stream, so the device never holds more than
  about one chunk of states beyond the parameters and gradients. Adam's update is per element, so stepping in
  chunks computes what one step computes. An optimizer stepped with a closure (which re-evaluates the loss) steps
  once, with every state on the device.
- A step's first call creates the states on the device (the optimizer's own lazy initialisation); they leave it
  when that chunk is done.
"""

from __future__ import annotations

import functools
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import registry
from ..sharding.dtensor import local_of
from .pinned_pool import HostBlocks, PinnedPool, flat_bytes

INSTALLED_ATTRIBUTE = "_trl_turbo_state_offload"
# States smaller than this stay on the device (norms, biases: a rounding error of the memory, and many copies)
MIN_STATE_BYTES = 4 << 20
# Host storage comes in pinned chunks of this size (`PinnedPool`: exact, where a pinned tensor of its own would be
# rounded up to a power of two)
HOST_CHUNK_BYTES = 4 << 20


class OptimizerStateOffload:
    """Installs itself on `optimizer` (its `step`, and hooks around `state_dict`/`load_state_dict`), after any LR
    scheduler wrapped its `step`; `pin`: page-lock the host buffers (CUDA)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, chunk_bytes: int = 1 << 30, pin: bool = True,
                 min_state_bytes: int = MIN_STATE_BYTES, host_chunk_bytes: int = HOST_CHUNK_BYTES) -> None:
        self.optimizer = optimizer
        self.chunk_bytes = chunk_bytes
        self.pin = pin
        self.min_state_bytes = min_state_bytes
        self._pool = PinnedPool(budget_bytes=2**62, chunk_bytes=host_chunk_bytes, pin=pin,
                                purpose="optimizer state offload",
                                remedy="Set `turbo_offload_optimizer_states=False` to keep them on the GPU.")
        # (id of a parameter's state dict, the state's name) -> its host storage, and the state it holds the values of
        self._host: dict[tuple[int, str], HostBlocks] = {}
        self._resident: dict[tuple[int, str], torch.Tensor] = {}
        self._timing: _StepTiming | None = None  # the last step's, until its metric is read
        self._step = original = optimizer.step
        if hasattr(original, "_wrapped_by_lr_sched"):  # an LR scheduler counts the steps through it: keep its mark
            @functools.wraps(original)
            def step(closure: Callable[[], Any] | None = None) -> Any:
                return self.step(closure)
        else:  # a method of the optimizer, as a scheduler created later expects to wrap
            step = types.MethodType(_offloaded_step, optimizer)
        registry.set_attr(optimizer, "step", step, weak=True)
        registry.set_attr(optimizer, INSTALLED_ATTRIBUTE, self, weak=True)
        self._hooks = [optimizer.register_state_dict_pre_hook(lambda _optimizer: self.fetch_all()),
                       optimizer.register_load_state_dict_post_hook(lambda _optimizer: self._forget())]

    @property
    def host_bytes(self) -> int:
        """Host memory the states take (whole pinned chunks)."""
        return self._pool.allocated_bytes - self._pool.free_bytes

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The optimizer's step, chunk by chunk (whole with a `closure`), each chunk's states on the device only for
        its part of the step."""
        if closure is not None:
            self.fetch_all()
            loss = self._step(closure)
            self._send(self._all_states())
            return loss
        timing = _StepTiming(self.pin)
        groups = self.optimizer.param_groups
        everything = [group["params"] for group in groups]
        try:
            for chunk in self._chunks(everything):
                states = self._states(p for params in chunk for p in params)
                self._fetch(states)
                for group, params in zip(groups, chunk, strict=True):
                    group["params"] = params
                self._step()
                self._send(self._states(p for params in chunk for p in params))  # new ones too (the first step)
        finally:
            for group, params in zip(groups, everything, strict=True):
                group["params"] = params
        self._timing = timing.stop()
        return None

    def take_metrics(self) -> dict[str, float]:
        """The last step's time (copies included; read when asked, never waited for in the step) and the host memory
        the states take, as metrics."""
        metrics = {"offload/optimizer_states_host_gib": self.host_bytes / 2**30}
        if self._timing is not None:
            metrics["offload/optimizer_step_s"] = self._timing.seconds()
            self._timing = None
        return metrics

    def fetch_all(self) -> None:
        """Every state back on the device (before `state_dict`, or a step with a closure)."""
        self._fetch(self._all_states())

    def close(self) -> None:
        """Every state back on the device, the optimizer as it was."""
        self.fetch_all()
        for hook in self._hooks:
            hook.remove()
        registry.restore_attr(self.optimizer, "step")
        registry.restore_attr(self.optimizer, INSTALLED_ATTRIBUTE)
        self._forget()
        self._pool.close()

    # ------------------------------------------------------------------------------------------------ internals
    def _all_states(self) -> list[tuple[dict[str, Any], str]]:
        return self._states(p for group in self.optimizer.param_groups for p in group["params"])

    def _forget(self) -> None:
        """After `load_state_dict`: the loaded states are new tensors on the device; the old host storage is free for
        them."""
        for blocks in self._host.values():
            self._pool.release(blocks)
        self._host.clear()
        self._resident.clear()

    def _chunks(self, everything: list[list[torch.Tensor]]) -> Iterator[list[list[torch.Tensor]]]:
        """Each group's parameters cut into runs whose states (measured as the parameters' bytes times the states per
        parameter, or the parameters' own bytes before the first step) reach `chunk_bytes`, walked in order."""
        chunk: list[list[torch.Tensor]] = [[] for _ in everything]
        size = 0
        for index, params in enumerate(everything):
            for param in params:
                chunk[index].append(param)
                states = [holder[name] for holder, name in self._states([param])]
                size += sum(_nbytes(local_of(s)) for s in states) if states else _nbytes(local_of(param))
                if size >= self.chunk_bytes:
                    yield chunk
                    chunk, size = [[] for _ in everything], 0
        if any(chunk):
            yield chunk

    def _states(self, params: Any) -> list[tuple[dict[str, Any], str]]:
        """Where the states of `params` that move are kept: (the parameter's state dict, the state's name) of each
        tensor of at least `min_state_bytes` and more than one element (a step counter stays)."""
        found = []
        for param in params:
            state = self.optimizer.state.get(param, {})
            found += [(state, name) for name, value in state.items()
                      if isinstance(value, torch.Tensor) and value.numel() > 1
                      and _nbytes(local_of(value)) >= self.min_state_bytes]
        return found

    @torch.no_grad()
    def _send(self, states: list[tuple[dict[str, Any], str]]) -> None:
        for holder, name in states:
            value = holder[name]
            local = local_of(value)
            if local.untyped_storage().nbytes() == 0:
                continue  # sent already
            if not _owns_resizable_storage(local):  # a view, or loaded from a file: a copy of its own moves
                holder[name] = value = value.clone(memory_format=torch.contiguous_format)
                local = local_of(value)
            key = (id(holder), name)
            blocks = self._host.get(key)
            if blocks is None or self._resident.get(key) is not value:
                if blocks is not None:
                    self._pool.release(blocks)
                blocks = self._pool.acquire(_nbytes(local))
                self._host[key], self._resident[key] = blocks, value
            blocks.store(flat_bytes(local), non_blocking=self.pin)
            local.untyped_storage().resize_(0)  # stream-ordered: the copy above reads it first

    @torch.no_grad()
    def _fetch(self, states: list[tuple[dict[str, Any], str]]) -> None:
        for holder, name in states:
            local = local_of(holder[name])
            if local.untyped_storage().nbytes() != 0:
                continue  # on the device (never sent, or loaded since)
            blocks = self._host[(id(holder), name)]
            local.untyped_storage().resize_(blocks.nbytes)
            blocks.load(flat_bytes(local), non_blocking=self.pin)


class _StepTiming:
    """A step's time: CUDA events on the current stream where the copies run there (the host never waits for them
    in the step), else the wall clock."""

    def __init__(self, cuda: bool) -> None:
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
        if self._events is not None:
            self._events[0].record()
        self._start, self._end = time.perf_counter(), None

    def stop(self) -> _StepTiming:
        if self._events is not None:
            self._events[1].record()
        self._end = time.perf_counter()
        return self

    def seconds(self) -> float:
        if self._events is None:
            return self._end - self._start
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1000


def _owns_resizable_storage(tensor: torch.Tensor) -> bool:
    storage = tensor.untyped_storage()
    return (storage.resizable() and tensor.is_contiguous() and tensor.storage_offset() == 0
            and storage.nbytes() == _nbytes(tensor))


def _offloaded_step(optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    return installed(optimizer).step(closure)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def installed(optimizer: Any) -> OptimizerStateOffload | None:
    """The offload installed on `optimizer` or the torch optimizer inside it (None: none)."""
    return getattr(torch_optimizer(optimizer), INSTALLED_ATTRIBUTE, None)


def torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside `optimizer` (accelerate's wrapper, itself an Optimizer, holds it as `.optimizer`)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def install(optimizer: Any, device: torch.device) -> OptimizerStateOffload:
    """The offload on the torch optimizer inside `optimizer` (accelerate's wrapper or the optimizer itself), installed
    once; refused (ValueError, before any step) when Adam-like states of the trained parameters would not fit the
    host's share of pinned memory for this process."""
    from ..distributed import local_process_count
    from ..host_memory import OFFLOAD_HOST_FRACTION, available_host_bytes

    optimizer = torch_optimizer(optimizer)
    existing = installed(optimizer)
    if existing is not None:
        return existing
    expected = 2 * sum(_nbytes(local_of(p)) for group in optimizer.param_groups for p in group["params"])
    share = available_host_bytes() * OFFLOAD_HOST_FRACTION / local_process_count()
    if expected > share:
        raise ValueError(f"trl_turbo: `turbo_offload_optimizer_states=True` needs about {expected / 2**30:.1f} GiB of "
                         f"pinned host memory for this process's optimizer states, and its share of the host's "
                         f"available memory is {share / 2**30:.1f} GiB. Set it to False, or train on more GPUs.")
    return OptimizerStateOffload(optimizer, pin=device.type == "cuda", min_state_bytes=MIN_STATE_BYTES,
                                 host_chunk_bytes=HOST_CHUNK_BYTES)
