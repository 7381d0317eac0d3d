"""What a decoder layer that keeps its activations (the memory plan's "keep") actually stores for its backward pass.

Design decision: the layer runs as written, under saved-tensor hooks that store each value once and nothing that
two saved tensors already determine. Measured on a LoRA Llama layer under bf16 autocast (PEFT keeps adapters in
fp32, so each LoRA casts its input to fp32 and autocast casts it back), about 40% of what autograd saves is
redundant:
- **Copies.** q/k/v's LoRAs each save their own bf16 copy of the same normed input (gate/up's likewise): a chain of
  casts through fp32 back to the source's dtype, bitwise the source. Copies of one source with the same dtype and
  geometry are stored once.
- **Products.** The MLP's `act(gate) * up` runs as `ops.gated_product` (saving gate and up, not the activation's
  output), and the down projection's LoRA saves a cast of that product: it is rebuilt from gate and up when the
  backward pass needs it (an elementwise op) instead of being stored.
A saved tensor is matched only through the autograd graph: views after value-preserving casts (every cast's dtype at
least as wide as the source's, the last one any of them) of one source node's output, on one device. Copies are
assumed to lay their source out alike (`Tensor.to` preserves the layout) and the source not to change between them
(an in-place write under no_grad would go unseen). Everything else is stored as autograd would store it. Values and
gradients are bitwise those of plain autograd.

What is stored is detached (a saved output would otherwise hold its own node in a cycle the garbage collector cannot
break when no backward pass runs) with its version, checked at unpack: hooks skip autograd's own in-place check.
Hooks nest by replacement, not composition, so these are pushed only around a kept layer (never inside a checkpoint,
whose recompute relies on its own hooks; a user's outer hooks would not see the layer's tensors). They count what they
store (storages other than the parameters' once each: the planner's measurement of a kept layer) and what plain
autograd would have stored (the working set of a layer's backward or recompute).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..ops.gated_product import is_gated_product_node, recompute_gated_product

# Autograd nodes of ops whose output is a view of their input (shares its storage)
VIEW_NODES = frozenset({
    "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "TBackward0", "TransposeBackward0",
    "TransposeBackward1", "PermuteBackward0", "AliasBackward0", "SqueezeBackward0", "SqueezeBackward1",
    "SqueezeBackward2", "SqueezeBackward3", "SqueezeBackward4", "UnsqueezeBackward0", "AsStridedBackward0",
    "ExpandBackward0",
})
CAST_NODE = "ToCopyBackward0"
# Dtypes that hold every value of a source dtype exactly
_WIDER = {
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float16: (torch.float32, torch.float64),
    torch.float32: (torch.float64,),
}


@dataclass(frozen=True)
class _Rebuilt:
    """A saved tensor that is a view of a cast of a `GatedProduct`'s output: rebuilt at unpack."""

    node: object
    dtype: torch.dtype
    device: torch.device
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def materialize(self) -> torch.Tensor:
        product = recompute_gated_product(self.node).to(device=self.device, dtype=self.dtype)
        return product.as_strided(self.size, self.stride, self.offset)


@dataclass(frozen=True)
class _Stored:
    """A saved tensor kept as it is (detached), with its version at pack time."""

    tensor: torch.Tensor
    version: int

    def materialize(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError("one of the variables needed for gradient computation has been modified by an inplace "
                               f"operation (version {self.version} saved, {self.tensor._version} now; a layer "
                               "trl_turbo's memory plan keeps)")
        return self.tensor


def _output_dtype(node: object, output_nr: int) -> torch.dtype | None:
    metadata = getattr(node, "_input_metadata", None)  # per output of the node: its dtype, shape, device
    if metadata is None or output_nr >= len(metadata):
        return None
    return metadata[output_nr].dtype


def cast_source(tensor: torch.Tensor) -> tuple[object, int, int] | None:
    """(source node, its output index, casts) when `tensor` is views of value-preserving casts of that output (the
    longest such chain; no cast: views of the output itself); else None."""
    node = tensor.grad_fn
    output_nr = tensor.output_nr
    while node is not None and node.name() in VIEW_NODES:
        node, output_nr = node.next_functions[0]
    if node is None:
        return None
    casts: list[object] = []  # nearest first
    source_of: list[tuple[object, int]] = [(node, output_nr)]  # the node and output before i casts
    while node is not None and node.name() == CAST_NODE:
        casts.append(node)
        node, output_nr = node.next_functions[0]
        source_of.append((node, output_nr))
    cast_dtypes = [_output_dtype(cast, 0) for cast in casts]
    for length in range(len(casts), -1, -1):
        source, output_nr = source_of[length]
        if source is None:
            continue
        source_dtype = _output_dtype(source, output_nr)
        allowed = (source_dtype, *_WIDER.get(source_dtype, ()))
        if source_dtype is not None and all(dtype in allowed for dtype in cast_dtypes[:length]):
            return source, output_nr, length
    return None


class KeptLayerSaver:
    """The pack/unpack pair of one kept layer's forward (see the module docstring). `excluded_storages`: storages
    not counted (the parameters')."""

    def __init__(self, excluded_storages: set[int] | None = None) -> None:
        self.excluded = excluded_storages or set()
        self.copies: dict[tuple, _Stored] = {}  # keyed by the source node itself, which the key keeps alive
        self.sizes: dict[int, int] = {}  # what is stored, per storage
        self.plain_sizes: dict[int, int] = {}  # what plain autograd would store, per storage

    def pack(self, tensor: torch.Tensor) -> _Stored | _Rebuilt:
        self._count(tensor, self.plain_sizes)
        source = cast_source(tensor) if tensor.grad_fn is not None else None
        if source is not None:
            node, output_nr, casts = source
            geometry = (tensor.dtype, tensor.device, tuple(tensor.shape), tuple(tensor.stride()),
                        tensor.storage_offset())
            if is_gated_product_node(node):
                return _Rebuilt(node, *geometry)
        stored = _Stored(tensor.detach(), tensor._version)
        if source is not None and source[2] > 0:  # a copy: stored once per source, dtype, device and geometry
            key = (node, output_nr, *geometry)
            if key in self.copies:
                return self.copies[key]
            self.copies[key] = stored
        self._count(tensor, self.sizes)
        return stored

    def _count(self, tensor: torch.Tensor, sizes: dict[int, int]) -> None:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self.excluded:
            sizes[pointer] = max(sizes.get(pointer, 0), storage.nbytes())

    @staticmethod
    def unpack(packed: _Stored | _Rebuilt) -> torch.Tensor:
        return packed.materialize()


@contextlib.contextmanager
def lean_saved_tensors(excluded_storages: set[int] | None = None) -> Iterator[list[int]]:
    """Within the block, autograd stores what a kept layer saves without copies or rebuildable products. At exit the
    yielded list holds the bytes stored and the bytes plain autograd would have stored (distinct storages,
    `excluded_storages` not counted)."""
    saver = KeptLayerSaver(excluded_storages)
    totals = [0, 0]
    try:
        with torch.autograd.graph.saved_tensors_hooks(saver.pack, saver.unpack):
            yield totals
    finally:
        totals[:] = [sum(saver.sizes.values()), sum(saver.plain_sizes.values())]
        saver.copies.clear()
