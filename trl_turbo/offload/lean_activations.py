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
least as wide as the source's, the last one any of them) of one source node's output. Everything else is stored as
autograd would store it. Values and gradients are bitwise those of plain autograd.

Hooks nest by replacement, not composition, so these are pushed only where no other saved-tensor hooks run: around
a kept layer (never inside a checkpoint, whose recompute relies on its own hooks). They also count what they store
(storages other than the parameters' once each): the planner's measurement of a kept layer.
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
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def materialize(self) -> torch.Tensor:
        product = recompute_gated_product(self.node).to(self.dtype)
        return product.as_strided(self.size, self.stride, self.offset)


def _output_dtype(node: object, output_nr: int) -> torch.dtype | None:
    metadata = getattr(node, "_input_metadata", None)  # per output of the node: its dtype, shape, device
    if metadata is None or output_nr >= len(metadata):
        return None
    return metadata[output_nr].dtype


def cast_source(tensor: torch.Tensor) -> tuple[object, int, int] | None:
    """(source node, its output index, casts) when `tensor` is views of value-preserving casts of that output (the
    longest such chain; no cast: views of the output itself); else None."""
    node = tensor.grad_fn
    output_nr = 0
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
        self.copies: dict[tuple, torch.Tensor] = {}
        self.sources: list[object] = []  # keeps the source nodes (the copies' keys hold their ids) alive
        self.sizes: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | _Rebuilt:
        source = cast_source(tensor) if tensor.grad_fn is not None else None
        if source is not None:
            node, output_nr, casts = source
            geometry = (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
            if is_gated_product_node(node):
                return _Rebuilt(node, *geometry)
        if source is not None and source[2] > 0:  # a copy: stored once per source, dtype and geometry
            key = (id(node), output_nr, *geometry)
            if key in self.copies:
                return self.copies[key]
            self.copies[key] = tensor
            self.sources.append(node)
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self.excluded:
            self.sizes[pointer] = max(self.sizes.get(pointer, 0), storage.nbytes())
        return tensor

    @staticmethod
    def unpack(packed: torch.Tensor | _Rebuilt) -> torch.Tensor:
        return packed.materialize() if isinstance(packed, _Rebuilt) else packed

    @property
    def stored_bytes(self) -> int:
        return sum(self.sizes.values())


@contextlib.contextmanager
def lean_saved_tensors(excluded_storages: set[int] | None = None) -> Iterator[list[int]]:
    """Within the block, autograd stores what a kept layer saves without copies or rebuildable products; the bytes
    stored (distinct storages, `excluded_storages` not counted) are in the yielded list's only element at exit."""
    saver = KeptLayerSaver(excluded_storages)
    total = [0]
    try:
        with torch.autograd.graph.saved_tensors_hooks(saver.pack, saver.unpack):
            yield total
    finally:
        total[0] = saver.stored_bytes
        saver.copies.clear()
        saver.sources.clear()
