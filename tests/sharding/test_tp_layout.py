"""`tp_layout` against slices written out by hand from vLLM 0.24's loaders (the 0.24.0 wheel from PyPI; 0.31.0's
arithmetic is the same):

- `vllm/model_executor/layers/linear.py`, `QKVParallelLinear.__init__` (num_heads = heads / T; num_kv_heads =
  kv / T, or 1 with num_kv_head_replicas = T / kv when T >= kv) and `QKVParallelLinear.weight_loader` /
  `weight_loader_v2` (offsets q 0, k num_heads*head_size, v (num_heads + num_kv_heads)*head_size; the loaded
  tensor narrowed at `shard_rank * shard_size`, shard_rank = tp_rank for q, tp_rank // num_kv_head_replicas for
  k and v; `parameter.py` `_ColumnvLLMParameter.load_qkv_weight` does the same);
- `MergedColumnParallelLinear.weight_loader` / `weight_loader_v2` (offset sum(output_sizes[:i]) / T, narrowed at
  tp_rank * shard_size; `load_merged_column_weight`);
- `RowParallelLinear.weight_loader` (input dim narrowed at tp_rank * in/T; `RowvLLMParameter.
  load_row_parallel_weight`); its bias is created whole (`Parameter(torch.empty(self.output_size))`);
- `vllm/model_executor/layers/vocab_parallel_embedding.py`, `pad_vocab_size` (to 64), `VocabParallelEmbedding.
  _get_indices` / `weight_loader` (rank r: rows [min(r*P, V), min((r+1)*P, V)) at the top of a P-row tensor, the
  rest zero-filled).
"""

from __future__ import annotations

import pytest
import torch

from trl_turbo.planning.shapes import build_config
from trl_turbo.sharding.tp_layout import (
    ModelFacts,
    Obstacle,
    TPSizeError,
    VllmSlice,
    check_tp_size,
    fsdp2_chunk,
    packed_name,
    tp_layout,
    vllm_tp_sizes,
)
from trl_turbo.vllm.weight_views import plan_shared_views

LLAMA_8B = ModelFacts.from_config(build_config("llama-3.1-8b"))  # the bench shapes are the one table of them
QWEN_32B = ModelFacts.from_config(build_config("qwen2.5-32b"))
TINY = ModelFacts(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                  vocab_size=100)

ATTN = "model.layers.3.self_attn"
MLP = "model.layers.3.mlp"


def hf_shapes(facts: ModelFacts, prefix: str = "model.layers.3", bias: bool = False) -> dict[str, tuple[int, ...]]:
    hd, hidden = facts.head_dim, facts.hidden_size
    q, kv, inter = facts.num_attention_heads * hd, facts.num_key_value_heads * hd, facts.intermediate_size
    shapes = {
        f"{prefix}.self_attn.q_proj.weight": (q, hidden), f"{prefix}.self_attn.k_proj.weight": (kv, hidden),
        f"{prefix}.self_attn.v_proj.weight": (kv, hidden), f"{prefix}.self_attn.o_proj.weight": (hidden, q),
        f"{prefix}.mlp.gate_proj.weight": (inter, hidden), f"{prefix}.mlp.up_proj.weight": (inter, hidden),
        f"{prefix}.mlp.down_proj.weight": (hidden, inter), f"{prefix}.input_layernorm.weight": (hidden,),
        "model.embed_tokens.weight": (facts.vocab_size, hidden), "lm_head.weight": (facts.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if bias:
        shapes |= {f"{prefix}.self_attn.q_proj.bias": (q,), f"{prefix}.self_attn.k_proj.bias": (kv,),
                   f"{prefix}.self_attn.v_proj.bias": (kv,)}
    return shapes


def at(facts, name, tp, rank, **kwargs):
    return tp_layout(name, hf_shapes(facts, bias=True)[name], facts, tp, rank, **kwargs)


# (name, T, rank) -> (vLLM name, dim, start, stop, offset in the rank's packed tensor, the rank's tensor size)
LLAMA_8B_SLICES = {
    # T=1: the packed tensors are the whole concatenations, q | k | v = 4096 + 1024 + 1024 rows
    (f"{ATTN}.q_proj.weight", 1, 0): (f"{ATTN}.qkv_proj.weight", 0, 0, 4096, 0, 6144),
    (f"{ATTN}.k_proj.weight", 1, 0): (f"{ATTN}.qkv_proj.weight", 0, 0, 1024, 4096, 6144),
    (f"{ATTN}.v_proj.weight", 1, 0): (f"{ATTN}.qkv_proj.weight", 0, 0, 1024, 5120, 6144),
    (f"{MLP}.up_proj.weight", 1, 0): (f"{MLP}.gate_up_proj.weight", 0, 0, 14336, 14336, 28672),
    (f"{ATTN}.o_proj.weight", 1, 0): (f"{ATTN}.o_proj.weight", 1, 0, 4096, 0, 4096),
    # T=2, rank 1: 16 heads (2048 rows) of q, 4 KV heads (512 rows) each of k and v
    (f"{ATTN}.q_proj.weight", 2, 1): (f"{ATTN}.qkv_proj.weight", 0, 2048, 4096, 0, 3072),
    (f"{ATTN}.k_proj.weight", 2, 1): (f"{ATTN}.qkv_proj.weight", 0, 512, 1024, 2048, 3072),
    (f"{ATTN}.v_proj.weight", 2, 1): (f"{ATTN}.qkv_proj.weight", 0, 512, 1024, 2560, 3072),
    (f"{MLP}.gate_proj.weight", 2, 1): (f"{MLP}.gate_up_proj.weight", 0, 7168, 14336, 0, 14336),
    (f"{MLP}.up_proj.weight", 2, 1): (f"{MLP}.gate_up_proj.weight", 0, 7168, 14336, 7168, 14336),
    (f"{ATTN}.o_proj.weight", 2, 1): (f"{ATTN}.o_proj.weight", 1, 2048, 4096, 0, 2048),
    (f"{MLP}.down_proj.weight", 2, 1): (f"{MLP}.down_proj.weight", 1, 7168, 14336, 0, 7168),
    ("model.embed_tokens.weight", 2, 1): ("model.embed_tokens.weight", 0, 64128, 128256, 0, 64128),
    # T=4, rank 3: 8 heads of q (1024 rows), 2 KV heads (256 rows)
    (f"{ATTN}.q_proj.weight", 4, 3): (f"{ATTN}.qkv_proj.weight", 0, 3072, 4096, 0, 1536),
    (f"{ATTN}.k_proj.weight", 4, 3): (f"{ATTN}.qkv_proj.weight", 0, 768, 1024, 1024, 1536),
    (f"{ATTN}.v_proj.weight", 4, 3): (f"{ATTN}.qkv_proj.weight", 0, 768, 1024, 1280, 1536),
    (f"{MLP}.down_proj.weight", 4, 3): (f"{MLP}.down_proj.weight", 1, 10752, 14336, 0, 3584),
    # T=8 (= KV heads), rank 5: 4 q heads, exactly one KV head (head 5), no replication
    (f"{ATTN}.q_proj.weight", 8, 5): (f"{ATTN}.qkv_proj.weight", 0, 2560, 3072, 0, 768),
    (f"{ATTN}.k_proj.weight", 8, 5): (f"{ATTN}.qkv_proj.weight", 0, 640, 768, 512, 768),
    (f"{ATTN}.v_proj.weight", 8, 5): (f"{ATTN}.qkv_proj.weight", 0, 640, 768, 640, 768),
    (f"{MLP}.gate_proj.weight", 8, 5): (f"{MLP}.gate_up_proj.weight", 0, 8960, 10752, 0, 3584),
    ("lm_head.weight", 8, 7): ("lm_head.weight", 0, 112224, 128256, 0, 16032),
    # T=16 > 8 KV heads, rank 5: 2 q heads; num_kv_heads 1, num_kv_head_replicas 2 -> KV head 5 // 2 = 2
    (f"{ATTN}.q_proj.weight", 16, 5): (f"{ATTN}.qkv_proj.weight", 0, 1280, 1536, 0, 512),
    (f"{ATTN}.k_proj.weight", 16, 5): (f"{ATTN}.qkv_proj.weight", 0, 256, 384, 256, 512),
    (f"{ATTN}.v_proj.weight", 16, 5): (f"{ATTN}.qkv_proj.weight", 0, 256, 384, 384, 512),
    (f"{MLP}.up_proj.weight", 16, 5): (f"{MLP}.gate_up_proj.weight", 0, 4480, 5376, 896, 1792),
    (f"{ATTN}.o_proj.weight", 16, 15): (f"{ATTN}.o_proj.weight", 1, 3840, 4096, 0, 256),
    ("model.embed_tokens.weight", 16, 15): ("model.embed_tokens.weight", 0, 120240, 128256, 0, 8016),
}


@pytest.mark.parametrize(("key", "expected"), LLAMA_8B_SLICES.items(), ids=lambda v: str(v))
def test_llama_8b_slices_match_vllm_loaders(key, expected):
    name, tp, rank = key
    vllm_name, dim, start, stop, offset, local = expected
    layout = at(LLAMA_8B, name, tp, rank)
    assert layout.vllm_name == vllm_name
    assert layout.slice == VllmSlice(dim, start, stop, offset, local)


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_llama_8b_coincides_everywhere_but_replicated_kv_and_norms(tp):
    """Llama-3.1-8B: 128256 = 2004 x 64 needs no vocabulary padding, every dim divides by T <= 16; only T=16 > 8 KV
    heads replicates k and v (each rank a whole KV head, FSDP2 would give it half of one)."""
    for name, shape in hf_shapes(LLAMA_8B).items():
        for rank in range(tp):
            layout = tp_layout(name, shape, LLAMA_8B, tp, rank)
            if name.endswith("norm.weight"):
                assert layout.obstacle == (None if tp == 1 else Obstacle.REPLICATED), name
            elif tp == 16 and (".k_proj." in name or ".v_proj." in name):
                assert layout.obstacle == Obstacle.KV_REPLICATED, name
                start, stop, _ = fsdp2_chunk(1024, 16, rank)
                assert (start, stop) == (64 * rank, 64 * rank + 64)
                assert (layout.slice.start, layout.slice.stop) == (128 * (rank // 2), 128 * (rank // 2) + 128)
            else:
                assert layout.coincides, (name, tp, rank, layout.detail)


def test_qwen_32b_at_8_coincides_with_bias_rows():
    """Qwen2.5-32B, T=8, rank 3: 5 of 40 heads (640 rows), KV head 3 (128 rows); the q/k/v biases are sliced like the
    weights (ColumnParallelLinear's bias has output_dim=0 and QKVParallelLinear.weight_loader); 27648 / 8 = 3456 rows
    of gate and up; 152064 = 2376 x 64, so the vocabulary is split without padding into 19008-row blocks."""
    cases = {
        f"{ATTN}.q_proj.weight": (0, 1920, 2560, 0, 896),
        f"{ATTN}.q_proj.bias": (0, 1920, 2560, 0, 896),
        f"{ATTN}.k_proj.weight": (0, 384, 512, 640, 896),
        f"{ATTN}.v_proj.bias": (0, 384, 512, 768, 896),
        f"{MLP}.gate_proj.weight": (0, 10368, 13824, 0, 6912),
        f"{MLP}.up_proj.weight": (0, 10368, 13824, 3456, 6912),
        f"{MLP}.down_proj.weight": (1, 10368, 13824, 0, 3456),
        f"{ATTN}.o_proj.weight": (1, 1920, 2560, 0, 640),
        "model.embed_tokens.weight": (0, 57024, 76032, 0, 19008),
    }
    for name, expected in cases.items():
        layout = at(QWEN_32B, name, 8, 3)
        assert layout.slice == VllmSlice(*expected), name
        assert layout.coincides, (name, layout.detail)


def test_qwen_32b_sizes_vllm_refuses():
    """40 heads: vLLM's divide(40, T) fails for T=16, so there is no layout to coincide with; check_tp_size says
    which sizes work."""
    assert vllm_tp_sizes(QWEN_32B) == [1, 2, 4, 8]
    layout = at(QWEN_32B, f"{ATTN}.q_proj.weight", 16, 0)
    assert layout.obstacle == Obstacle.INDIVISIBLE and layout.slice is None and "40 attention heads" in layout.detail
    with pytest.raises(TPSizeError, match=r"accepts: \[1, 2, 4, 8\]"):
        check_tp_size(QWEN_32B, 16)
    check_tp_size(QWEN_32B, 8)


def test_tiny_model_padded_vocabulary_does_not_coincide():
    """Vocabulary 100 pads to 128: at T=2 vLLM's rank 0 holds rows [0, 64) and rank 1 rows [64, 100) + 28 zero rows,
    while FSDP2's chunks are [0, 50) and [50, 100)."""
    rank0, rank1 = (at(TINY, "model.embed_tokens.weight", 2, r) for r in (0, 1))
    assert rank0.slice == VllmSlice(0, 0, 64, 0, 64) and rank1.slice == VllmSlice(0, 64, 100, 0, 64)
    assert rank0.obstacle == rank1.obstacle == Obstacle.VOCAB_PADDED
    # At T=1 the HF rows are the first 100 of vLLM's 128: FSDP2's unpadded whole tensor is a view of them.
    assert at(TINY, "lm_head.weight", 1, 0).coincides


def test_padded_vocabulary_coincides_when_the_blocks_are_fsdp2_chunks():
    """V = 1020 pads to 1024 = 16 x 64 and ceil(1020 / 16) = 64: vLLM's rank 15 holds rows [960, 1020) and 4 zero
    rows, FSDP2's rank 15 the same rows padded with 4 zero rows to 64: the same storage."""
    facts = ModelFacts(hidden_size=256, num_attention_heads=16, num_key_value_heads=16, head_dim=16,
                       intermediate_size=512, vocab_size=1020)
    last = tp_layout("model.embed_tokens.weight", (1020, 256), facts, 16, 15)
    assert last.slice == VllmSlice(0, 960, 1020, 0, 64) and last.coincides
    assert fsdp2_chunk(1020, 16, 15) == (960, 1020, 64)


def test_tiny_model_kv_replication_and_t1_norms():
    layout = at(TINY, f"{ATTN}.v_proj.weight", 4, 3)  # 2 KV heads over 4 ranks: rank 3 holds head 1
    assert layout.slice == VllmSlice(0, 16, 32, 16 + 16, 48) and layout.obstacle == Obstacle.KV_REPLICATED
    assert at(TINY, f"{ATTN}.v_proj.weight", 2, 1).coincides
    assert at(TINY, "model.norm.weight", 1, 0).coincides
    assert at(TINY, "model.norm.weight", 2, 1).obstacle == Obstacle.REPLICATED


def test_obstacles_for_4bit_unknown_and_shape_mismatch():
    assert at(TINY, f"{ATTN}.q_proj.weight", 2, 0, quantized_4bit=True).obstacle == Obstacle.PACKED_4BIT
    packed = tp_layout(f"{ATTN}.q_proj.weight", (64 * 64 // 2, 1), TINY, 2, 0)  # Params4bit's uint8 storage
    assert packed.obstacle == Obstacle.SHAPE_MISMATCH
    assert tp_layout("model.layers.0.mlp.router.weight", (8, 64), TINY, 2, 0).obstacle == Obstacle.UNKNOWN
    row_bias = tp_layout(f"{ATTN}.o_proj.bias", (64,), TINY, 2, 1)
    assert row_bias.obstacle == Obstacle.REPLICATED and row_bias.slice.dim is None


def test_peft_names_are_reduced_like_weight_views():
    layout = tp_layout(f"base_model.model.{ATTN}.k_proj.base_layer.weight", (32, 64), TINY, 2, 1)
    assert layout.hf_name == f"{ATTN}.k_proj.weight" and layout.vllm_name == f"{ATTN}.qkv_proj.weight"
    assert packed_name(f"{MLP}.up_proj.weight") == (f"{MLP}.gate_up_proj.weight", 1)
    assert packed_name("model.norm.weight") == ("model.norm.weight", None)


@pytest.mark.parametrize("facts", [LLAMA_8B, QWEN_32B, TINY], ids=["llama8b", "qwen32b", "tiny"])
def test_t1_layout_is_weight_views_plan(facts):
    """At T=1 every rank-0 slice is the SharedView `plan_shared_views` gives (the one-GPU sharing already in use)."""
    shapes = hf_shapes(facts, bias=True)
    del shapes["lm_head.weight"]  # plan with an untied head separately below
    vllm_params = {}
    for name, shape in shapes.items():
        layout = tp_layout(name, shape, facts, 1, 0)
        vllm_params[layout.vllm_name] = (layout.slice.local_size, *shape[1:]) if layout.slice.dim == 0 else shape
    views = {v.hf_name: v for v in plan_shared_views(shapes, vllm_params, {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                                                           "gate_up_proj": ["gate_proj", "up_proj"]})}
    for name, shape in shapes.items():
        layout = tp_layout(name, shape, facts, 1, 0)
        view = views[name]
        assert (view.vllm_name, view.start, view.stop) == (layout.vllm_name, layout.slice.offset,
                                                           layout.slice.offset + shape[0]), name


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_coinciding_slices_are_fsdp2_chunks_and_rebuild_the_packed_tensor(tp):
    """A rank's packed vLLM tensors, filled from the coinciding slices, equal the concatenation vLLM's loader
    builds: qkv = [q_r | k_r | v_r], gate_up = [gate_r | up_r] (small Llama-shaped model with 8 KV heads)."""
    facts = ModelFacts(hidden_size=128, num_attention_heads=16, num_key_value_heads=8, head_dim=8,
                       intermediate_size=256, vocab_size=512)
    shapes = hf_shapes(facts)
    weights = {name: torch.randn(shape) for name, shape in shapes.items()}
    q, k, v = (weights[f"{ATTN}.{p}_proj.weight"] for p in "qkv")
    gate, up = weights[f"{MLP}.gate_proj.weight"], weights[f"{MLP}.up_proj.weight"]
    for rank in range(tp):
        packed: dict[str, torch.Tensor] = {}
        for name, tensor in weights.items():
            layout = tp_layout(name, tensor.shape, facts, tp, rank)
            if layout.slice.dim is None:
                continue
            assert layout.coincides, layout.detail
            start, stop, padded = fsdp2_chunk(tensor.shape[layout.fsdp_dim], tp, rank)
            assert (start, stop, padded) == (layout.slice.start, layout.slice.stop, layout.slice.length)
            shard = torch.chunk(tensor, tp, dim=layout.fsdp_dim)[rank]  # FSDP2's shard (even chunks here)
            sizes = list(tensor.shape)
            sizes[layout.slice.dim] = layout.slice.local_size
            target = packed.setdefault(layout.vllm_name, torch.zeros(sizes))
            target.narrow(layout.slice.dim, layout.slice.offset, layout.slice.length).copy_(shard)
        qn, kvn = 16 // tp * 8, 8 // tp * 8
        expected_qkv = torch.cat([q[rank * qn:(rank + 1) * qn], k[rank * kvn:(rank + 1) * kvn],
                                  v[rank * kvn:(rank + 1) * kvn]])
        inter = 256 // tp
        expected_gate_up = torch.cat([gate[rank * inter:(rank + 1) * inter], up[rank * inter:(rank + 1) * inter]])
        assert torch.equal(packed[f"{ATTN}.qkv_proj.weight"], expected_qkv)
        assert torch.equal(packed[f"{MLP}.gate_up_proj.weight"], expected_gate_up)
        cols = 128 // tp
        assert torch.equal(packed[f"{ATTN}.o_proj.weight"], weights[f"{ATTN}.o_proj.weight"][:, rank * cols:
                                                                                            (rank + 1) * cols])


@pytest.mark.parametrize(("size", "world"), [(10, 4), (7, 8), (0, 2), (1020, 16), (100, 2), (64, 4)])
def test_fsdp2_chunk_is_torch_chunk_with_empty_tails(size, world):
    chunks = list(torch.arange(size).chunk(world)) if size else []
    chunks += [torch.arange(0)] * (world - len(chunks))
    for rank, chunk in enumerate(chunks):
        start, stop, padded = fsdp2_chunk(size, world, rank)
        assert list(range(start, stop)) == chunk.tolist()
        assert padded == (len(chunks[0]) if size else 0)


def test_rank_outside_the_group_is_refused():
    with pytest.raises(ValueError, match="outside"):
        at(TINY, f"{ATTN}.q_proj.weight", 2, 2)


def test_facts_from_an_hf_config():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                         vocab_size=100, tie_word_embeddings=True)
    facts = ModelFacts.from_config(config)
    assert (facts.head_dim, facts.num_key_value_heads, facts.padded_vocab_size) == (16, 2, 128)
    assert facts.tie_word_embeddings
