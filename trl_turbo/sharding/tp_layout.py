"""Which slice of which HF weight vLLM's tensor-parallel rank r holds, and whether FSDP2's shard of it is that slice.

Design: the layout is computed from the same integer arithmetic as vLLM's weight loaders (vLLM 0.24
`model_executor/layers/linear.py`, `parameter.py`, `vocab_parallel_embedding.py`), from config facts alone, so it
needs neither a GPU nor vLLM. Rank r holds, of each HF weight:

- q/k/v (`QKVParallelLinear`): rows `[s*n, (s+1)*n)` with `n` = the rank's heads x head_dim, `s` = r for q and
  `r // replicas` for k and v (KV heads are replicated when T > num_key_value_heads), stacked in the rank's
  packed tensor at offsets 0, q_rows, q_rows + kv_rows;
- gate/up (`MergedColumnParallelLinear`): rows `[r*I/T, (r+1)*I/T)` at offsets 0 and I/T;
- o/down (`RowParallelLinear`): columns `[r*in/T, (r+1)*in/T)`; a row-parallel bias is whole on every rank;
- embeddings and LM head (`VocabParallelEmbedding`): rows `[min(r*P, V), min((r+1)*P, V))` with `P` = the
  vocabulary padded to 64, over T; the rank's tensor has `P` rows, zero past V;
- everything else (norms): the whole tensor on every rank.

FSDP2 with `Shard(d)` over a T-rank shard group gives rank r the `torch.chunk` block of dim d (chunk size
`ceil(size/T)`, the last ones short or empty, every rank's storage padded to the first's size). The two coincide,
i.e. rank r's FSDP2 shard can be a view into its vLLM tensor, when the HF ranges are equal and FSDP2's padded
storage fits inside the vLLM tensor over rows that are vLLM's zero padding or nothing. When they do not, the layout
says why (`Obstacle`): vLLM would refuse T itself, KV heads are replicated, the vocabulary's padded blocks are not
FSDP2's chunks, the weight is 4-bit packed, or vLLM keeps the whole tensor on every rank. Naming follows
`trl_turbo.vllm.weight_views`: PEFT names are reduced with `hf_weight_name`, and an HF weight whose module is listed
in the model's `packed_modules_mapping` lives in the packed vLLM parameter in the listed order.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trl_turbo.vllm.weight_views import hf_weight_name

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
# Llama/Qwen2/Mistral-style models' `packed_modules_mapping` in vLLM.
PACKED_MODULES: Mapping[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
ROW_PARALLEL: frozenset[str] = frozenset({"o_proj", "down_proj"})
# The decoder layers' linear projections (the layers vLLM's fp8 engine quantizes)
PROJECTIONS: frozenset[str] = frozenset({m for members in PACKED_MODULES.values() for m in members} | ROW_PARALLEL)
EMBEDDINGS: frozenset[str] = frozenset({"embed_tokens"})
LM_HEADS: frozenset[str] = frozenset({"lm_head"})


class Obstacle(str, enum.Enum):
    """Why rank r's FSDP2 shard of a weight cannot be its vLLM slice (the weight keeps a copy of its own in vLLM)."""

    INDIVISIBLE = "indivisible"  # vLLM cannot split this weight over T ranks (it refuses to start at that T)
    KV_REPLICATED = "kv_replicated"  # T > KV heads: each rank holds a whole KV head, several ranks the same one
    VOCAB_PADDED = "vocab_padded"  # vLLM's blocks of the 64-padded vocabulary are not FSDP2's chunks
    PACKED_4BIT = "packed_4bit"  # bitsandbytes 4-bit storage: not rows of the weight
    REPLICATED = "replicated"  # vLLM holds the whole tensor on every rank (norms, a row-parallel bias)
    SHAPE_MISMATCH = "shape_mismatch"  # the HF shape is not what the config says
    UNKNOWN = "unknown"  # not a weight of a layer whose tensor-parallel layout is known here
    DTYPE = "dtype"  # the training copy's dtype is not the engine's (e.g. fp32 masters, bf16 vLLM)


@dataclass(frozen=True)
class ModelFacts:
    """The config numbers the tensor-parallel layout depends on."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False

    @classmethod
    def from_config(cls, config: Any) -> ModelFacts:
        """From an HF config; `head_dim` defaults to hidden_size // heads as vLLM's Llama does."""
        heads = config.num_attention_heads
        return cls(
            hidden_size=config.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // VOCAB_PADDING) * VOCAB_PADDING


@dataclass(frozen=True)
class VllmSlice:
    """Rank r's vLLM tensor holds HF elements `[start, stop)` of `dim` at `[offset, offset + stop - start)` of the
    same dim; `local_size` is that tensor's length along `dim` (packed total, or padded vocabulary block).
    `dim=None`: the whole HF tensor (not split)."""

    dim: int | None
    start: int
    stop: int
    offset: int
    local_size: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class TPLayout:
    """Rank `rank` of `tp_size`: the vLLM parameter holding HF weight `hf_name`, its slice (None where vLLM cannot
    place it), and `obstacle` None when FSDP2's `Shard(fsdp_dim)` shard on this rank is exactly that slice."""

    hf_name: str
    vllm_name: str
    tp_size: int
    rank: int
    slice: VllmSlice | None
    fsdp_dim: int
    obstacle: Obstacle | None
    detail: str = ""

    @property
    def coincides(self) -> bool:
        return self.obstacle is None


class TPSizeError(ValueError):
    """vLLM cannot run this model at this tensor-parallel size."""


def fsdp2_chunk(size: int, world: int, rank: int) -> tuple[int, int, int]:
    """FSDP2's shard of a dim of `size` on `rank` of `world`: (start, stop, padded length), as `torch.chunk` with
    empty trailing chunks (FSDP2's `_chunk_with_empty`); every rank's storage is padded to chunk 0's length."""
    chunk = -(-size // world) if size else 0
    start = min(rank * chunk, size)
    return start, min(start + chunk, size), chunk


def packed_name(hf_name: str, packed_modules: Mapping[str, Sequence[str]] = PACKED_MODULES) -> tuple[str, int | None]:
    """vLLM's name for an HF weight and its index among the packed shards (None: not packed), the rule of
    `trl_turbo.vllm.weight_views.plan_shared_views`."""
    module, _, leaf = hf_name.rpartition(".")
    parent, _, child = module.rpartition(".")
    for packed, shards in packed_modules.items():
        if child in shards:
            return (f"{parent}.{packed}.{leaf}" if parent else f"{packed}.{leaf}"), list(shards).index(child)
    return hf_name, None


def vllm_refusal(facts: ModelFacts, tp_size: int) -> str | None:
    """Why vLLM refuses to shard this model over `tp_size` ranks (the `divide` and asserts of its layers), or None."""
    heads, kv = facts.num_attention_heads, facts.num_key_value_heads
    if tp_size < 1:
        return f"tensor-parallel size must be >= 1, got {tp_size}"
    if heads % tp_size:
        return f"{heads} attention heads are not divisible by T={tp_size} (QKVParallelLinear: divide(heads, T))"
    if kv >= tp_size and kv % tp_size:
        return f"{kv} KV heads are not divisible by T={tp_size}"
    if kv < tp_size and tp_size % kv:
        return f"T={tp_size} is not a multiple of the {kv} KV heads it would replicate"
    if facts.intermediate_size % tp_size:
        return (f"intermediate size {facts.intermediate_size} is not divisible by T={tp_size} "
                "(MergedColumnParallelLinear asserts it)")
    if facts.padded_vocab_size % tp_size:
        return f"padded vocabulary {facts.padded_vocab_size} is not divisible by T={tp_size}"
    return None


def vllm_tp_sizes(facts: ModelFacts, candidates: Sequence[int] = (1, 2, 4, 8, 16)) -> list[int]:
    """The candidate tensor-parallel sizes vLLM accepts for this model."""
    return [t for t in candidates if vllm_refusal(facts, t) is None]


def check_tp_size(facts: ModelFacts, tp_size: int) -> None:
    """Raise TPSizeError (naming the sizes that work) when vLLM would refuse `tp_size`."""
    reason = vllm_refusal(facts, tp_size)
    if reason:
        raise TPSizeError(f"vLLM cannot run this model at tensor-parallel size {tp_size}: {reason}; sizes it "
                          f"accepts: {vllm_tp_sizes(facts)}")


def _kv_split(facts: ModelFacts, tp_size: int) -> tuple[int, int]:
    """(KV heads per rank, ranks per KV head), QKVParallelLinear.__init__'s num_kv_heads / num_kv_head_replicas."""
    kv = facts.num_key_value_heads
    if tp_size >= kv:
        return 1, tp_size // kv
    return kv // tp_size, 1


def _expected_shape(kind: str, index: int | None, child: str, leaf: str, facts: ModelFacts) -> tuple[int, ...]:
    """The HF shape the config gives a weight (bias: its first dim)."""
    hd, hidden = facts.head_dim, facts.hidden_size
    if kind == "qkv":
        out_in = ((facts.num_attention_heads if index == 0 else facts.num_key_value_heads) * hd, hidden)
    elif kind == "gate_up":
        out_in = (facts.intermediate_size, hidden)
    elif kind == "row":
        out_in = (hidden, facts.num_attention_heads * hd if child == "o_proj" else facts.intermediate_size)
    else:
        out_in = (facts.vocab_size, hidden)
    return out_in if leaf == "weight" else out_in[:1]


def tp_layout(name: str, shape: Sequence[int], facts: ModelFacts, tp_size: int, rank: int, *,
              packed_modules: Mapping[str, Sequence[str]] = PACKED_MODULES, quantized_4bit: bool = False) -> TPLayout:
    """Rank `rank`'s share of HF weight `name` (a model or PEFT parameter name) of shape `shape` under vLLM tensor
    parallelism of size `tp_size`, and whether FSDP2's shard on the same rank coincides with it."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of {tp_size}")
    shape = tuple(int(s) for s in shape)
    hf_name = hf_weight_name(name)
    vllm_name, index = packed_name(hf_name, packed_modules)
    module, _, leaf = hf_name.rpartition(".")
    child = module.rpartition(".")[2]
    packed = vllm_name.rpartition(".")[0].rpartition(".")[2] if index is not None else None

    def layout(slice_: VllmSlice | None, fsdp_dim: int, obstacle: Obstacle | None = None,
               detail: str = "") -> TPLayout:
        if obstacle is None and slice_ is not None:
            obstacle, detail = _fsdp_mismatch(slice_, kind, shape, fsdp_dim, tp_size, rank)
        return TPLayout(hf_name, vllm_name, tp_size, rank, slice_, fsdp_dim, obstacle, detail)

    if packed == "qkv_proj":
        kind = "qkv"
    elif packed == "gate_up_proj":
        kind = "gate_up"
    elif index is None and child in ROW_PARALLEL:
        kind = "row"
    elif index is None and (child in EMBEDDINGS or child in LM_HEADS):
        kind = "vocab"
    elif index is None and len(shape) <= 1:
        kind = "whole"
    else:
        kind = "unknown"
        return layout(None, 0, Obstacle.UNKNOWN, f"no tensor-parallel layout is known here for {hf_name!r}")

    refusal = vllm_refusal(facts, tp_size)
    if refusal:
        return layout(None, 0, Obstacle.INDIVISIBLE, f"vLLM refuses T={tp_size}: {refusal}")
    if kind == "whole":  # norms: vLLM's RMSNorm etc. hold the whole tensor on every rank
        size = shape[0] if shape else 1
        return layout(VllmSlice(None, 0, size, 0, size), 0)
    if quantized_4bit:
        return layout(None, 0, Obstacle.PACKED_4BIT, "4-bit packed storage: FSDP2's rows are not the weight's rows")
    expected = _expected_shape(kind, index, child, leaf, facts)
    if shape != expected:
        return layout(None, 0, Obstacle.SHAPE_MISMATCH,
                      f"shape {shape} is not the {expected} the config gives (a packed 4-bit weight, or a config "
                      "that does not describe this model)")

    if kind == "qkv":
        heads_r = facts.num_attention_heads // tp_size
        kv_r, replicas = _kv_split(facts, tp_size)
        q_rows, kv_rows = heads_r * facts.head_dim, kv_r * facts.head_dim
        local = q_rows + 2 * kv_rows
        if index == 0:
            return layout(VllmSlice(0, rank * q_rows, (rank + 1) * q_rows, 0, local), 0)
        shard_rank = rank // replicas
        offset = q_rows if index == 1 else q_rows + kv_rows
        slice_ = VllmSlice(0, shard_rank * kv_rows, (shard_rank + 1) * kv_rows, offset, local)
        if replicas > 1:
            return layout(slice_, 0, Obstacle.KV_REPLICATED,
                          f"T={tp_size} > {facts.num_key_value_heads} KV heads: rank {rank} holds KV head "
                          f"{shard_rank} whole (as do {replicas - 1} other rank(s)); FSDP2 would give it "
                          f"1/{tp_size} of the rows")
        return layout(slice_, 0)
    if kind == "gate_up":
        rows = facts.intermediate_size // tp_size
        return layout(VllmSlice(0, rank * rows, (rank + 1) * rows, index * rows, 2 * rows), 0)
    if kind == "row":
        if leaf != "weight":  # RowParallelLinear's bias: not split, added on rank 0 only
            return layout(VllmSlice(None, 0, shape[0], 0, shape[0]), 0)
        cols = shape[1] // tp_size
        return layout(VllmSlice(1, rank * cols, (rank + 1) * cols, 0, cols), 1)
    # Embeddings and LM head: VocabParallelEmbedding._get_indices, no LoRA-added tokens (vLLM 0.24 adds none)
    vocab, block = facts.vocab_size, facts.padded_vocab_size // tp_size
    return layout(VllmSlice(0, min(rank * block, vocab), min((rank + 1) * block, vocab), 0, block), 0)


def _fsdp_mismatch(slice_: VllmSlice, kind: str, shape: tuple[int, ...], fsdp_dim: int, tp_size: int,
                   rank: int) -> tuple[Obstacle | None, str]:
    """(None, "") when FSDP2's Shard(fsdp_dim) shard on `rank` is `slice_`'s HF range and its padded storage lies in
    the vLLM tensor (padding only over vLLM's own zero rows of a vocabulary block); else the obstacle and why."""
    if slice_.dim is None:
        if tp_size == 1:
            return None, ""
        return Obstacle.REPLICATED, "vLLM keeps the whole tensor on every rank (a norm, or a row-parallel bias)"
    start, stop, padded = fsdp2_chunk(shape[fsdp_dim], tp_size, rank)
    if fsdp_dim != slice_.dim or (start, stop) != (slice_.start, slice_.stop):
        obstacle = Obstacle.VOCAB_PADDED if kind == "vocab" else Obstacle.INDIVISIBLE
        return obstacle, (f"vLLM's rank {rank} holds [{slice_.start}, {slice_.stop}) of dim {slice_.dim} (its "
                          f"vocabulary blocks are {slice_.local_size} rows of the {VOCAB_PADDING}-padded vocabulary)"
                          if kind == "vocab" else
                          f"vLLM's rank {rank} holds [{slice_.start}, {slice_.stop}) of dim {slice_.dim}") + \
            f"; FSDP2's shard is [{start}, {stop}) of dim {fsdp_dim}"
    if padded != slice_.length and (kind != "vocab" or slice_.offset + padded > slice_.local_size):
        return Obstacle.INDIVISIBLE, (f"FSDP2 pads rank {rank}'s shard to {padded} along dim {fsdp_dim}, past the "
                                      f"{slice_.length} that are this weight's in vLLM's tensor")
    return None, ""
