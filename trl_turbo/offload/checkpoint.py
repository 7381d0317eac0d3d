"""Gradient checkpointing whose saved layer inputs live in host memory between the forward and backward passes.

Design: one `torch.autograd.Function` per checkpointed layer call, reentrant style, so it owns exactly what is
saved. It keeps the layer's positional input and runs the layer under no_grad; the backward pass recomputes the
layer with grad and backpropagates through it. This is the same arithmetic as `torch.utils.checkpoint`.

Where the saved input lives is decided by `CheckpointOffloader`:
- Forward pass. The newest layer input stays on the device. When the next layer's call arrives, the previous one is
  copied to pinned host memory on a side stream (`d2h`), so the copy overlaps the next layer's compute. Its device
  memory returns to the allocator once the copy completes (`record_stream`). The last layer's input therefore never
  leaves the device, and it is the first one the backward pass needs.
- Backward pass. When layer i's backward starts, layer i−1's input is prefetched on another side stream (`h2d`).
  It arrives while layer i recomputes and backpropagates. At most two layer inputs are on the device at once.
- Budget. Host chunks come from a `PinnedPool`. It recycles them across steps and keeps its total under
  `host_budget_bytes`. Inputs beyond the budget stay on the device. If page-locking fails, pageable memory
  is used, with one warning.
- Without a device (CPU tensors) the same bookkeeping runs with synchronous copies, so tests exercise it.

The host and device copies are bitwise identical, so gradients are exactly those of plain checkpointing. Under
no_grad or inference mode the layer runs directly; nothing is saved or copied. The forward runs without a graph, so a
call whose bound keyword arguments hold a tensor that requires grad, or a dict or list the layer may fill, goes to
PyTorch's non-reentrant checkpoint instead (which tracks them).

Gradients leave the backward pass through the Function's outputs only. The layer's trainable parameters are inputs
of the Function, and the recompute differentiates with `torch.autograd.grad` (which writes no `.grad`), so every
parameter is accumulated once, by the outer backward pass, as for an uncheckpointed layer. DDP and ZeRO-1/2 hook
that accumulation to reduce gradients; a nested `backward()` would fire their hooks inside another backward pass,
where DDP refuses them. This needs the parameters whole when the function is called: under FSDP2 it is, from
transformers 5.23, whose layers checkpoint their `forward` inside FSDP2's hooks (FSDP2's pre-backward hook gathers them
again for the recompute); ZeRO-3 and FSDP1 gather them inside the call, so `trl_turbo.distributed` keeps the function
off there.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

from ..host_memory import offload_host_floor_bytes
from ..ops.autocast_state import autocast_state, restored_autocast
from .pinned_pool import DEFAULT_CHUNK_BYTES, HostBlocks, PinnedPool

_recomputing: contextvars.ContextVar[bool] = contextvars.ContextVar("trl_turbo_recomputing", default=False)


def is_recomputing() -> bool:
    """True while a checkpointed layer is being recomputed for its backward pass (its output values are unused)."""
    return _recomputing.get()


@dataclass
class OffloadStats:
    """Per training step: what moved, what stayed, and how long the compute stream waited for copies."""

    offloaded_bytes: int = 0
    kept_on_device_bytes: int = 0
    host_bytes_peak: int = 0
    blocking_fetches: int = 0
    wait_s: float = 0.0


class _Slot:
    """One saved layer input: on the device, on the host, or back on the device."""

    __slots__ = ("device_tensor", "host_blocks", "shape", "dtype", "pool", "prev", "produced", "offloaded",
                 "arrived", "nbytes", "consumed", "__weakref__")

    def __init__(self, tensor: torch.Tensor, prev: _Slot | None, produced: torch.cuda.Event | None,
                 pool: PinnedPool) -> None:
        self.device_tensor: torch.Tensor | None = tensor
        self.host_blocks: HostBlocks | None = None
        self.shape, self.dtype = tensor.shape, tensor.dtype
        self.pool = pool
        self.prev = prev
        self.produced = produced
        self.offloaded: torch.cuda.Event | None = None  # the device-to-host copy has finished writing the buffer
        self.arrived: torch.cuda.Event | None = None
        self.nbytes = tensor.numel() * tensor.element_size()
        self.consumed = False

    def __del__(self) -> None:
        # A forward pass whose backward never ran (an exception, a discarded graph): its chunks go back
        if self.host_blocks is not None:
            self.pool.release(self.host_blocks)


class CheckpointOffloader:
    """Moves saved layer inputs to host memory and back, one layer ahead of the backward pass."""

    def __init__(self, host_budget_bytes: int, *, min_bytes: int = 1 << 20,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.pool = PinnedPool(host_budget_bytes, chunk_bytes=chunk_bytes, pin=torch.cuda.is_available(),
                               host_floor_bytes=offload_host_floor_bytes())
        self.min_bytes = min_bytes
        self.stats = OffloadStats()
        # Weak: the autograd graph owns the slots; a graph dropped without backward frees them (and their buffers)
        self._newest: weakref.ref[_Slot] | None = None
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
        self._waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    # ------------------------------------------------------------------------------------------------ forward
    def save(self, tensor: torch.Tensor) -> _Slot:
        """Take ownership of a layer input; the previously saved input (if still waiting) goes to the host now."""
        cuda = tensor.is_cuda
        tensor = tensor if tensor.is_contiguous() else tensor.contiguous()  # copied out as flat bytes
        produced = None
        if cuda:
            produced = torch.cuda.Event()
            produced.record()
        newest = self._newest() if self._newest is not None else None
        prev = newest if newest is not None and not newest.consumed else None
        slot = _Slot(tensor, prev, produced, self.pool)
        if prev is not None and prev.device_tensor is not None and prev.host_blocks is None:
            self._to_host(prev)
        self._newest = weakref.ref(slot)
        return slot

    def _to_host(self, slot: _Slot) -> None:
        tensor = slot.device_tensor
        blocks = self.pool.acquire(slot.nbytes) if slot.nbytes >= self.min_bytes else None
        if blocks is None:  # too small to be worth it, or over the host budget
            self.stats.kept_on_device_bytes += slot.nbytes
            return
        flat = tensor.reshape(-1).view(torch.uint8)
        if tensor.is_cuda:
            d2h, _ = self._side_streams(tensor.device)
            d2h.wait_event(slot.produced)
            for event in blocks.pending_reads():  # copies that last read these chunks
                d2h.wait_event(event)
            with torch.cuda.stream(d2h):
                blocks.store(flat, non_blocking=True)
                slot.offloaded = torch.cuda.Event()
                slot.offloaded.record(d2h)
            tensor.record_stream(d2h)  # its memory is reused only after the copy has finished
        else:
            blocks.store(flat, non_blocking=False)
        slot.host_blocks, slot.device_tensor = blocks, None
        self.stats.offloaded_bytes += slot.nbytes
        self.stats.host_bytes_peak = max(self.stats.host_bytes_peak, self.pool.allocated_bytes)

    # ----------------------------------------------------------------------------------------------- backward
    def load(self, slot: _Slot) -> torch.Tensor:
        """The saved input of a layer whose backward pass starts now; prefetches the layer before it."""
        if self._newest is not None and self._newest() is slot:
            self._newest = None
        if slot.device_tensor is None:
            self.stats.blocking_fetches += 1
            self._to_device(slot)
        tensor = slot.device_tensor
        if slot.arrived is not None:
            self._wait(slot.arrived)
        if slot.prev is not None and slot.prev.device_tensor is None and not slot.prev.consumed:
            self._to_device(slot.prev)  # overlaps this layer's recompute and backward
        slot.device_tensor = slot.prev = None
        slot.consumed = True
        return tensor

    def _to_device(self, slot: _Slot) -> None:
        blocks = slot.host_blocks
        slot.host_blocks = None
        device = slot.produced.device if slot.produced is not None else None
        if device is None or device.type != "cuda":
            flat = torch.empty(slot.nbytes, dtype=torch.uint8)
            blocks.load(flat, non_blocking=False)
            slot.device_tensor = flat.view(slot.dtype).view(slot.shape)
            self.pool.release(blocks)
            return
        _, h2d = self._side_streams(device)
        # The copy back runs on another stream than the copy out: it must not read the chunks before they are
        # written (the last layers' inputs are needed right after they were offloaded).
        h2d.wait_event(slot.offloaded)
        with torch.cuda.stream(h2d):
            flat = torch.empty(slot.nbytes, dtype=torch.uint8, device=device)
            blocks.load(flat, non_blocking=True)
            slot.arrived = torch.cuda.Event()
            slot.arrived.record(h2d)
        flat.record_stream(torch.cuda.current_stream(device))
        slot.device_tensor = flat.view(slot.dtype).view(slot.shape)
        self.pool.release(blocks, slot.arrived)  # reusable once this copy has read them

    def _wait(self, event: torch.cuda.Event) -> None:
        stream = torch.cuda.current_stream()
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(event)
        after.record(stream)
        self._waits.append((before, after))

    def _side_streams(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]

    def take_stats(self) -> OffloadStats:
        """Return the statistics gathered since the last call and start a new window (synchronises timing events)."""
        stats, self.stats = self.stats, OffloadStats()
        for before, after in self._waits:
            after.synchronize()
            stats.wait_s += before.elapsed_time(after) / 1000.0
        self._waits.clear()
        self.stats.host_bytes_peak = self.pool.allocated_bytes
        return stats


@contextlib.contextmanager
def _recompute_state(cpu_rng: torch.Tensor, device_rng: tuple[torch.device, torch.Tensor] | None,
                     autocast: list[tuple[str, bool, torch.dtype]]) -> Iterator[None]:
    devices = [device_rng[0]] if device_rng is not None else []
    with torch.random.fork_rng(devices=devices, enabled=True), contextlib.ExitStack() as stack:
        torch.set_rng_state(cpu_rng)
        if device_rng is not None:
            torch.cuda.set_rng_state(device_rng[1], device_rng[0])
        stack.enter_context(restored_autocast(autocast))
        token = _recomputing.set(True)
        try:
            yield
        finally:
            _recomputing.reset(token)


class _OffloadedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function: Callable, offloader: CheckpointOffloader | None, param_count: int,
                _force_grad: torch.Tensor, hidden: torch.Tensor, *args_and_params: Any) -> Any:
        args = args_and_params[:len(args_and_params) - param_count]
        ctx.run_function = run_function
        ctx.offloader = offloader
        ctx.hidden_requires_grad = hidden.requires_grad
        ctx.cpu_rng = torch.get_rng_state()
        ctx.device_rng = (hidden.device, torch.cuda.get_rng_state(hidden.device)) if hidden.is_cuda else None
        ctx.autocast = autocast_state()
        tensor_positions = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.tensor_positions = tensor_positions
        ctx.other_args = [None if i in tensor_positions else a for i, a in enumerate(args)]
        ctx.save_for_backward(*(args[i] for i in tensor_positions), *args_and_params[len(args):])
        ctx.slot = offloader.save(hidden) if offloader is not None else hidden
        with torch.no_grad():
            return run_function(hidden, *args)

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if ctx.slot is None:
            raise RuntimeError("trl_turbo checkpoint: backward ran twice; retain_graph=True is not supported")
        hidden = ctx.offloader.load(ctx.slot) if ctx.offloader is not None else ctx.slot
        ctx.slot = None
        saved = ctx.saved_tensors
        saved_args, params = saved[:len(ctx.tensor_positions)], saved[len(ctx.tensor_positions):]
        args = list(ctx.other_args)
        for position, tensor in zip(ctx.tensor_positions, saved_args):
            args[position] = tensor.detach().requires_grad_(tensor.requires_grad)
        hidden = hidden.detach().requires_grad_(ctx.hidden_requires_grad)
        with _recompute_state(ctx.cpu_rng, ctx.device_rng, ctx.autocast), torch.enable_grad():
            outputs = ctx.run_function(hidden, *args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if torch.is_tensor(o) and o.requires_grad
                 and g is not None]
        tensor_args = [args[i] for i in ctx.tensor_positions]
        hidden_grad, *rest = _input_grads(pairs, [hidden, *tensor_args, *params])
        arg_grads: list[torch.Tensor | None] = [None] * len(args)
        for position, grad in zip(ctx.tensor_positions, rest):
            arg_grads[position] = grad
        param_grads = rest[len(tensor_args):]
        return (None, None, None, None, hidden_grad, *arg_grads, *param_grads)


def _input_grads(pairs: list[tuple[torch.Tensor, torch.Tensor]],
                 inputs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Gradients of `inputs` given (output, output gradient) `pairs`; None for inputs that need none or get none.
    `torch.autograd.grad` writes no `.grad`: the caller returns them through its Function's outputs."""
    grads: list[torch.Tensor | None] = [None] * len(inputs)
    differentiable = [i for i, tensor in enumerate(inputs) if tensor.requires_grad]
    if pairs and differentiable:
        found = torch.autograd.grad([o for o, _ in pairs], [inputs[i] for i in differentiable], [g for _, g in pairs],
                                    allow_unused=True)
        for i, grad in zip(differentiable, found):
            grads[i] = grad
    return grads


# A leaf that requires grad, passed to every checkpoint call so its output joins the autograd graph even when no
# input requires grad (frozen embeddings with trainable adapters inside the layer); one per device.
_force_grad_leaves: dict[torch.device, torch.Tensor] = {}


def _force_grad_leaf(device: torch.device) -> torch.Tensor:
    if device not in _force_grad_leaves:
        _force_grad_leaves[device] = torch.empty(0, device=device, requires_grad=True)
    return _force_grad_leaves[device]


def _keyword_needs_graph(function: Callable) -> bool:
    """Whether the keyword arguments bound into `function` (transformers binds the layer's keywords with
    `functools.partial`) hold a tensor that requires grad, or a dict or list the layer may write into."""
    keywords = getattr(function, "keywords", None) or {}

    def needs(value: Any) -> bool:
        if torch.is_tensor(value):
            return value.requires_grad
        if isinstance(value, (dict, list)):
            return True
        if isinstance(value, tuple):
            return any(needs(item) for item in value)
        return False

    return any(needs(value) for value in keywords.values())


def offloaded_checkpoint(offloader: CheckpointOffloader | None,
                         layer: torch.nn.Module | None = None) -> Callable[..., Any]:
    """A `_gradient_checkpointing_func` for transformers' GradientCheckpointingLayer (called as f(function, *args)).

    `layer`: the module whose call this function checkpoints; its trainable parameters receive their gradients through
    the Function's outputs (see the module docstring). Without it, trainable parameters must not be used inside."""

    def checkpoint(function: Callable, *args: Any, **_ignored: Any) -> Any:
        if not torch.is_grad_enabled() or not args or not torch.is_tensor(args[0]):
            return function(*args)
        if _keyword_needs_graph(function):
            # The forward runs without a graph: a keyword tensor that needs a gradient, or a container the layer
            # fills, would come out detached. PyTorch's own non-reentrant checkpoint tracks them.
            return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
        hidden = args[0]
        params = [p for p in layer.parameters() if p.requires_grad] if layer is not None else []
        return _OffloadedCheckpoint.apply(function, offloader, len(params), _force_grad_leaf(hidden.device), hidden,
                                          *args[1:], *params)

    checkpoint.__trl_turbo_offloader__ = offloader
    return checkpoint
