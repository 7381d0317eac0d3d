"""The optimizer's states in pinned host memory between steps, streamed through the device in chunks at each step.

Design decisions:
- What moves is every tensor the optimizer keeps per parameter (Adam's two moments; any optimizer's tensors of more
  than one element on the device), never the parameters or their gradients: a full fine-tuning's 8 bytes per trained
  parameter leave the device for the forward, backward and generation, and the step still runs on the device, with
  the optimizer's own kernels.
- A state keeps its identity: its device storage is resized to nothing and back, with its values in pinned chunks
  of a `PinnedPool` (exact sizes; a pinned tensor of its own would be rounded up to a power of two). States under
  `MIN_STATE_BYTES` (norms, biases) stay on the device. FSDP2's states (DTensors) and plain tensors are moved alike,
  through their local tensors.
- `state_dict` returns device copies of the moving states (of their host values, or clones where a failed step left
  them on the device) and leaves the live ones on the host, so the next step never empties a tensor the caller
  holds. The copies are what stock's `state_dict` returns: every state on the device, the same type (a DTensor's
  layout kept: the distributed checkpoint's collectives read it there), here only while the caller holds the dict
  (a checkpoint's save, after the step, when training holds no activations). Host copies would add the states'
  size to pageable host memory beside the pinned one, where running out kills the process instead of raising.
- `load_state_dict` takes the loaded values to the host at once, the optimizer then holding new empty tensors: the
  device never holds the loaded states, and the caller's tensors (which torch keeps where no move was needed) are
  never emptied.
- A step walks the parameters in chunks of about `chunk_bytes` of states: the optimizer steps one chunk's parameters
  at a time (each parameter group narrowed to them for that call, its hyper-parameters untouched). Adam's update is
  per element, so stepping in chunks computes what one step computes. An optimizer stepped with a closure (which
  re-evaluates the loss) steps once, with every state on the device.
- **The copies overlap.** On CUDA, host-to-device copies run on one side stream and device-to-host copies on another,
  so chunk i+1 arrives while chunk i steps and chunk i-1 leaves: PCIe carries both directions at once and the step
  costs about one direction's transfer, not two plus the update (8B full fine-tuning on 2 x H200: 30 GiB of Adam's
  states per GPU each way, 1.30 s a step when every copy ran on the compute stream). The device holds about three
  chunks of states at a time (`CHUNK_BYTES`): a state sent away is freed once its copy is done (the allocator waits
  on the copy stream), and before a chunk's memory is allocated the host waits for the send two chunks back, whose
  memory it then reuses (the host runs far ahead of the copies otherwise, and every chunk would take new memory).
  States are allocated on the compute stream, so training reuses their memory. The next step's fetches, and
  `state_dict`, wait for the last sends. On CPU the same schedule runs with synchronous copies.
- A step's first call creates the states on the device (the optimizer's own lazy initialisation); they leave it
  when that chunk is done.
- **A share of them moves** (`share`, `turbo_offload_optimizer_states` between 0 and 1): the parameters whose states
  move are the first ones the step walks until they reach that share of the parameters' bytes (Adam's states are a
  fixed multiple of them, and which parameters move is decided before any state exists): at least the share leaves
  the device, by at most one parameter more. The others' states stay on the device like the small ones, and cost no
  transfer. The choice is kept as positions in the parameter groups, so parameters the optimizer is handed again
  (FSDP2's shards for the whole tensors) keep it, and parameters added later stay on the device. With every state
  moving (share 1), every parameter's move, as they always did.
"""

from __future__ import annotations

import contextlib
import functools
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import registry
from ..sharding.dtensor import local_of, with_local
from .pinned_pool import HostBlocks, PinnedPool, flat_bytes

INSTALLED_ATTRIBUTE = "_trl_turbo_state_offload"
# States smaller than this stay on the device (norms, biases: a rounding error of the memory, and many copies)
MIN_STATE_BYTES = 4 << 20
# States stepped at a time: with the copies overlapped about three such chunks are on the device at once (arriving,
# updated, leaving), after the backward pass has freed the activations
CHUNK_BYTES = 512 << 20
# Host storage comes in pinned chunks of this size (`PinnedPool`: exact, where a pinned tensor of its own would be
# rounded up to a power of two)
HOST_CHUNK_BYTES = 4 << 20


class OptimizerStateOffload:
    """Installs itself on `optimizer` (its `step`, and hooks around `state_dict`/`load_state_dict`), after any LR
    scheduler wrapped its `step`; `pin`: page-lock the host buffers (CUDA)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, chunk_bytes: int = CHUNK_BYTES, pin: bool = True,
                 device: torch.device | None = None, share: float = 1.0,
                 min_state_bytes: int = MIN_STATE_BYTES, host_chunk_bytes: int = HOST_CHUNK_BYTES) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.optimizer = optimizer
        self.chunk_bytes = chunk_bytes
        self.share = share
        self.pin = pin
        self.device = device  # of the states, where the copy streams live (None: the current CUDA device)
        self.min_state_bytes = min_state_bytes
        self._pool = PinnedPool(budget_bytes=2**62, chunk_bytes=host_chunk_bytes, pin=pin,
                                purpose="optimizer state offload",
                                remedy="Set `turbo_offload_optimizer_states` lower to keep more of them on the GPU.")
        # (id of a parameter's state dict, the state's name) -> its host storage, and the state it holds the values of
        self._host: dict[tuple[int, str], HostBlocks] = {}
        self._resident: dict[tuple[int, str], torch.Tensor] = {}
        # with a share under 1: the (group, index) positions of the parameters whose states move, chosen once, and
        # their ids in the groups as they stood at the last step or state_dict call (None: every parameter moves)
        self._moving_positions: list[tuple[int, int]] | None = None
        self._moving_ids: frozenset[int] | None = None
        self._timing: _StepTiming | None = None  # the last step's, until its metric is read
        self._streams: _CopyStreams | None = None  # made at the first step
        self._step = original = optimizer.step
        if hasattr(original, "_wrapped_by_lr_sched"):  # an LR scheduler counts the steps through it: keep its mark
            @functools.wraps(original)
            def step(closure: Callable[[], Any] | None = None) -> Any:
                return self.step(closure)
        else:  # a method of the optimizer, as a scheduler created later expects to wrap
            step = types.MethodType(_offloaded_step, optimizer)
        registry.set_attr(optimizer, "step", step, weak=True)
        registry.set_attr(optimizer, INSTALLED_ATTRIBUTE, self, weak=True)
        self._hooks = [optimizer.register_state_dict_post_hook(self._detached_state_dict),
                       optimizer.register_load_state_dict_post_hook(self._take_loaded)]

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
            self._send(self._all_states(), self._copy_streams())
            return loss
        streams = self._copy_streams()
        timing = _StepTiming(self.pin)
        self._refresh_moving()
        groups = self.optimizer.param_groups
        everything = [group["params"] for group in groups]
        chunks = list(self._chunks(everything))
        if not chunks:  # no parameters: the optimizer's own step still runs (its hooks, a scheduler's count)
            return self._step()
        streams.wait(streams.fetch, streams.send)  # the host copies the last step's sends wrote are complete
        sent: list[torch.cuda.Event | None] = []
        try:
            arrived = self._prefetch(chunks[0], streams)
            for index, chunk in enumerate(chunks):
                streams.current_waits(arrived)
                if index + 1 < len(chunks):
                    # the next chunk's copy starts now, beside this chunk's update and the last chunk's send; its
                    # memory is the chunk before that one's, once sent: the host waits for that send, or every
                    # prefetch would take new memory while the sends are still queued
                    if index >= 2:
                        streams.host_waits(sent[index - 2])
                    arrived = self._prefetch(chunks[index + 1], streams)
                for group, params in zip(groups, chunk, strict=True):
                    group["params"] = params
                self._step()
                self._send(self._states(p for params in chunk for p in params), streams)  # new ones too
                sent.append(streams.mark(streams.send))
        finally:
            for group, params in zip(groups, everything, strict=True):
                group["params"] = params
        self._timing = timing.stop(streams.send)
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
        """Every state back on the device (for a step with a closure, or removal), on the current stream."""
        self._refresh_moving()
        streams = self._copy_streams()
        streams.current_waits(streams.mark(streams.send))
        streams.current_waits(streams.mark(streams.fetch))  # a prefetch a failed step left running
        self._fetch(self._all_states(), streams)

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
    @torch.no_grad()
    def _detached_state_dict(self, _optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """`state_dict`'s per-parameter dicts are the optimizer's live ones: each that holds a moving state is
        replaced by a new dict whose moving states are device copies."""
        self._refresh_moving()
        streams = self._copy_streams()
        streams.current_waits(streams.mark(streams.send))  # the host values are complete
        streams.current_waits(streams.mark(streams.fetch))  # a prefetch a failed step left running
        moving = {(id(holder), name) for holder, name in self._all_states()}
        for index, holder in list(state_dict["state"].items()):
            names = [name for name in holder if (id(holder), name) in moving]
            if names:
                state_dict["state"][index] = {**holder, **{name: self._copy_of(holder, name) for name in names}}
        return state_dict

    def _copy_of(self, holder: dict[str, Any], name: str) -> torch.Tensor:
        """A new device tensor (of the same type and DTensor layout) with a moving state's values."""
        value = holder[name]
        local = local_of(value)
        if local.untyped_storage().nbytes() != 0:  # on the device (a failed step's prefetch)
            copy = local.clone(memory_format=torch.contiguous_format)
        else:
            copy = torch.empty(local.shape, dtype=local.dtype, device=local.device)
            self._host[(id(holder), name)].load(flat_bytes(copy), non_blocking=False)
        return with_local(value, copy)

    @torch.no_grad()
    def _take_loaded(self, _optimizer: torch.optim.Optimizer) -> None:
        """After `load_state_dict`: the old host storage is released, each moving state's loaded values go to new
        host storage, and the optimizer holds an empty tensor of the state's shape in its place."""
        self._refresh_moving()
        streams = self._copy_streams()
        streams.host_waits(streams.mark(streams.send))  # no copy still writes into or reads from the old storage
        streams.host_waits(streams.mark(streams.fetch))
        self._forget()
        for holder, name in self._all_states():
            value = holder[name]
            local = local_of(value)
            blocks = self._pool.acquire(_nbytes(local))
            blocks.store(flat_bytes(local.contiguous()), non_blocking=False)
            empty = torch.empty_like(local, memory_format=torch.contiguous_format)
            empty.untyped_storage().resize_(0)
            holder[name] = with_local(value, empty)
            self._host[(id(holder), name)], self._resident[(id(holder), name)] = blocks, holder[name]

    def _all_states(self) -> list[tuple[dict[str, Any], str]]:
        return self._states(p for group in self.optimizer.param_groups for p in group["params"])

    def _forget(self) -> None:
        """Release every state's host storage (the states in the optimizer are no longer the ones it held)."""
        for blocks in self._host.values():
            self._pool.release(blocks)
        self._host.clear()
        self._resident.clear()

    def _chunks(self, everything: list[list[torch.Tensor]]) -> Iterator[list[list[torch.Tensor]]]:
        """Each group's parameters cut into runs whose moving states (measured as the parameters' bytes times the
        states per parameter, or the parameters' own bytes before the first step; nothing for a parameter whose
        states stay) reach `chunk_bytes`, walked in order."""
        chunk: list[list[torch.Tensor]] = [[] for _ in everything]
        size = 0
        for index, params in enumerate(everything):
            for param in params:
                chunk[index].append(param)
                if not self._moves(param):
                    continue
                states = [holder[name] for holder, name in self._states([param])]
                size += sum(_nbytes(local_of(s)) for s in states) if states else _nbytes(local_of(param))
                if size >= self.chunk_bytes:
                    yield chunk
                    chunk, size = [[] for _ in everything], 0
        if any(chunk):
            yield chunk

    def _states(self, params: Any) -> list[tuple[dict[str, Any], str]]:
        """Where the states of `params` that move are kept: (the parameter's state dict, the state's name) of each
        tensor of at least `min_state_bytes` (and not empty here) and more than one element (a step counter stays),
        of the parameters whose states move (`share`)."""
        found = []
        for param in params:
            if not self._moves(param):
                continue
            state = self.optimizer.state.get(param, {})
            found += [(state, name) for name, value in state.items()
                      if isinstance(value, torch.Tensor) and value.numel() > 1
                      and _nbytes(local_of(value)) >= max(1, self.min_state_bytes)]  # an empty shard stays
        return found

    def _moves(self, param: torch.Tensor) -> bool:
        """Whether `param`'s states move (`share`)."""
        if self.share >= 1.0:
            return True
        if self._moving_ids is None:
            self._refresh_moving()
        return id(param) in self._moving_ids

    def _refresh_moving(self) -> None:
        """With a share under 1: choose the moving positions once (`leading_share`), and map them to the parameters
        the groups hold now (called outside a step's narrowing of the groups)."""
        if self.share >= 1.0:
            return
        groups = [group["params"] for group in self.optimizer.param_groups]
        if self._moving_positions is None:
            self._moving_positions = leading_share(groups, self.share)
        self._moving_ids = frozenset(id(groups[g][i]) for g, i in self._moving_positions
                                     if g < len(groups) and i < len(groups[g]))

    def _copy_streams(self) -> _CopyStreams:
        if self._streams is None:
            cuda = self.pin and torch.cuda.is_available()
            self._streams = _CopyStreams((self.device or torch.device("cuda", torch.cuda.current_device()))
                                         if cuda else None)
        return self._streams

    def _prefetch(self, chunk: list[list[torch.Tensor]], streams: _CopyStreams) -> torch.cuda.Event | None:
        """Start bringing `chunk`'s states to the device, their memory allocated on the current stream (so training
        reuses it) and filled on the fetch stream; returns the event the chunk's update waits for."""
        self._fetch(self._states(p for params in chunk for p in params), streams, streams.fetch)
        return streams.mark(streams.fetch)

    @torch.no_grad()
    def _send(self, states: list[tuple[dict[str, Any], str]], streams: _CopyStreams) -> None:
        """Copy `states` to the host on the send stream once the current stream's work on them is done, and free
        their device storage (reused only after the copy: the allocator waits on that stream)."""
        moving = []
        for holder, name in states:
            local = local_of(holder[name])
            if local.untyped_storage().nbytes() == 0:
                continue  # sent already
            if not _owns_resizable_storage(local):  # a view, or loaded from a file: a copy of its own moves
                holder[name] = holder[name].clone(memory_format=torch.contiguous_format)  # on the current stream
            moving.append((holder, name))
        streams.wait(streams.send)
        with streams.on(streams.send):
            self._store(moving, streams.send)

    def _store(self, states: list[tuple[dict[str, Any], str]], stream: torch.cuda.Stream | None) -> None:
        for holder, name in states:
            value = holder[name]
            local = local_of(value)
            key = (id(holder), name)
            blocks = self._host.get(key)
            if blocks is None or self._resident.get(key) is not value:
                if blocks is not None:
                    self._pool.release(blocks)
                blocks = self._pool.acquire(_nbytes(local))
                self._host[key], self._resident[key] = blocks, value
            blocks.store(flat_bytes(local), non_blocking=self.pin)
            if stream is not None:
                local.record_stream(stream)  # the copy above reads it on that stream: freed after it
            local.untyped_storage().resize_(0)

    @torch.no_grad()
    def _fetch(self, states: list[tuple[dict[str, Any], str]], streams: _CopyStreams,
               stream: torch.cuda.Stream | None = None) -> None:
        """Bring `states` back into their own storage: allocated on the current stream, copied on `stream` (None:
        the current one) once the current stream's queued work is done."""
        arriving = []
        for holder, name in states:
            local = local_of(holder[name])
            if local.untyped_storage().nbytes() != 0:
                continue  # on the device (never sent, or loaded since)
            blocks = self._host[(id(holder), name)]
            local.untyped_storage().resize_(blocks.nbytes)
            arriving.append((local, blocks))
        streams.wait(stream)
        with streams.on(stream):
            for local, blocks in arriving:
                blocks.load(flat_bytes(local), non_blocking=self.pin)
                if stream is not None:
                    local.record_stream(stream)  # written on that stream: its memory is not reused before


class _CopyStreams:
    """The side streams a step's copies run on (CUDA), or none (CPU: every copy is synchronous, each method a no-op
    and `on` the current stream)."""

    def __init__(self, device: torch.device | None) -> None:
        self.device = device  # the compute stream waited for is this device's, whichever device is current
        self.fetch = torch.cuda.Stream(device) if device is not None else None
        self.send = torch.cuda.Stream(device) if device is not None else None

    @staticmethod
    def on(stream: torch.cuda.Stream | None) -> Any:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def wait(self, waiter: torch.cuda.Stream | None, waited: torch.cuda.Stream | None = None) -> None:
        """`waiter`'s later work waits for the work queued so far on `waited` (default: the device's current
        stream)."""
        if waiter is not None:
            waiter.wait_stream(waited if waited is not None else torch.cuda.current_stream(self.device))

    @staticmethod
    def mark(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        return stream.record_event() if stream is not None else None

    @staticmethod
    def host_waits(event: torch.cuda.Event | None) -> None:
        if event is not None:
            event.synchronize()

    def current_waits(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


class _StepTiming:
    """A step's time: CUDA events on the current stream where the copies run there (the host never waits for them
    in the step), else the wall clock."""

    def __init__(self, cuda: bool) -> None:
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
        if self._events is not None:
            self._events[0].record()
        self._start, self._end = time.perf_counter(), None

    def stop(self, last: torch.cuda.Stream | None = None) -> _StepTiming:
        """End the timing after the work queued so far on `last` (default: the current stream)."""
        if self._events is not None:
            self._events[1].record(last)
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


def leading_share(groups: list[list[torch.Tensor]], share: float) -> list[tuple[int, int]]:
    """The (group, index) positions of the first parameters, walked group by group, whose bytes (local shards) reach
    `share` of all of theirs: every one for a share of 1."""
    total = sum(_nbytes(local_of(p)) for params in groups for p in params)
    positions, taken = [], 0
    for g, params in enumerate(groups):
        for i, param in enumerate(params):
            if share < 1.0 and taken >= share * total:
                return positions
            positions.append((g, i))
            taken += _nbytes(local_of(param))
    return positions


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


def install(optimizer: Any, device: torch.device, share: float = 1.0) -> OptimizerStateOffload:
    """The offload of `share` of the states on the torch optimizer inside `optimizer` (accelerate's wrapper or the
    optimizer itself), installed once; refused (ValueError, before any step) when Adam-like states of that share of
    the trained parameters would not fit the host's share of pinned memory for this process."""
    from ..distributed import local_process_count
    from ..host_memory import OFFLOAD_HOST_FRACTION, available_host_bytes

    optimizer = torch_optimizer(optimizer)
    existing = installed(optimizer)
    if existing is not None:
        return existing
    groups = [group["params"] for group in optimizer.param_groups]
    expected = 2 * sum(_nbytes(local_of(groups[g][i])) for g, i in leading_share(groups, share))
    room = available_host_bytes() * OFFLOAD_HOST_FRACTION / local_process_count()
    if expected > room:
        raise ValueError(f"trl_turbo: `turbo_offload_optimizer_states={share:g}` needs about "
                         f"{expected / 2**30:.1f} GiB of pinned host memory for this process's optimizer states, and "
                         f"its share of the host's available memory is {room / 2**30:.1f} GiB. Set it lower, or train "
                         "on more GPUs.")
    return OptimizerStateOffload(optimizer, pin=device.type == "cuda", device=device, share=share,
                                 min_state_bytes=MIN_STATE_BYTES, host_chunk_bytes=HOST_CHUNK_BYTES)
