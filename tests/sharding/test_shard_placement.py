"""The placement plan and the `shard_placement_fn` built from it (pure; the FSDP2 run is in test_fsdp2_layout.py)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from trl_turbo.planning.shapes import build_config
from trl_turbo.sharding.shard_placement import (
    ParamSpec,
    ShardPlacementFn,
    fully_shard_takes_placement_fn,
    plan_model,
    plan_placements,
    shard_placement_fn,
)
from trl_turbo.sharding.tp_layout import ModelFacts, Obstacle, TPSizeError
from trl_turbo.testing.models import tiny_model

LLAMA_8B = ModelFacts.from_config(build_config("llama-3.1-8b"))  # the bench shapes are the one table of them


def llama_specs(facts: ModelFacts, layers: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, ParamSpec]:
    hd, hidden, inter = facts.head_dim, facts.hidden_size, facts.intermediate_size
    q, kv = facts.num_attention_heads * hd, facts.num_key_value_heads * hd
    specs = {"model.embed_tokens.weight": ParamSpec((facts.vocab_size, hidden), dtype)}
    for i in range(layers):
        p = f"model.layers.{i}"
        for name, shape in (("self_attn.q_proj", (q, hidden)), ("self_attn.k_proj", (kv, hidden)),
                            ("self_attn.v_proj", (kv, hidden)), ("self_attn.o_proj", (hidden, q)),
                            ("mlp.gate_proj", (inter, hidden)), ("mlp.up_proj", (inter, hidden)),
                            ("mlp.down_proj", (hidden, inter)), ("input_layernorm", (hidden,)),
                            ("post_attention_layernorm", (hidden,))):
            specs[f"{p}.{name}.weight"] = ParamSpec(shape, dtype)
    specs["model.norm.weight"] = ParamSpec((hidden,), dtype)
    specs["lm_head.weight"] = ParamSpec((facts.vocab_size, hidden), dtype)
    return specs


def tiny(kv_heads: int = 2, vocab: int = 128, **overrides):
    return tiny_model("llama", vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=kv_heads, head_dim=16, **overrides)


def test_projections_get_their_vllm_dims():
    plan = plan_model(tiny(), 2)
    dims = plan.shard_dims()
    for layer in range(2):
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert dims[f"model.layers.{layer}.{proj}.weight"] == 0
        for proj in ("self_attn.o_proj", "mlp.down_proj"):
            assert dims[f"model.layers.{layer}.{proj}.weight"] == 1
    shared = {p.name for p in plan.of_kind("shared")}
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= shared  # 128 = 2 x 64: no vocabulary padding
    own = plan.of_kind("own_copy")
    assert {p.obstacle for p in own} == {Obstacle.REPLICATED} and len(own) == 5  # 4 layer norms + final norm
    assert all(p.vllm_copy_bytes == 64 * 4 and p.shard_dim == 0 for p in own)


def test_replicated_kv_and_padded_vocab_keep_own_copies_with_their_bytes():
    plan = plan_model(tiny(kv_heads=1, vocab=100), 2)
    own = {p.name: p for p in plan.of_kind("own_copy")}
    k = own["model.layers.0.self_attn.k_proj.weight"]
    assert k.obstacle == Obstacle.KV_REPLICATED and k.shard_dim == 0
    assert k.vllm_copy_bytes == 16 * 64 * 4  # one whole KV head on each rank
    embed = own["model.embed_tokens.weight"]
    assert embed.obstacle == Obstacle.VOCAB_PADDED and embed.vllm_copy_bytes == 64 * 64 * 4  # a 64-row block
    assert plan.own_copy_bytes_per_rank == 2 * 2 * 16 * 64 * 4 + 2 * 64 * 64 * 4 + 5 * 64 * 4
    text = plan.describe()
    assert "kv_replicated: 4 weights" in text and "vocab_padded: 2 weights" in text


def test_llama_8b_own_copies_per_rank():
    """T=8: only the norms (65 x 4096 bf16) are vLLM's own; T=16 adds a whole KV head of k and of v per layer
    (128 rows x 4096 x 2 bytes each, 32 layers)."""
    specs = llama_specs(LLAMA_8B, layers=32)
    norms = 65 * 4096 * 2
    at8 = plan_placements(specs, LLAMA_8B, 8)
    assert at8.own_copy_bytes_per_rank == norms
    at16 = plan_placements(specs, LLAMA_8B, 16)
    assert at16.own_copy_bytes_per_rank == norms + 32 * 2 * 128 * 4096 * 2
    total = sum(torch.Size(s.shape).numel() * 2 for s in specs.values())
    assert at8.shared_bytes_per_rank == pytest.approx((total - norms) / 8, abs=64)


def test_refused_tp_size_raises():
    with pytest.raises(TPSizeError, match="accepts"):
        plan_placements(llama_specs(LLAMA_8B, 1), LLAMA_8B, 3)


def test_dtype_other_than_the_engines_is_cast_into_its_slice():
    """fp32 masters over a bf16 engine: the shard is still the slice (same placement), cast into vLLM's copy."""
    plan = plan_model(tiny(), 2, engine_dtype=torch.bfloat16)  # the tiny model is fp32
    q = next(p for p in plan.params if p.name.endswith("0.self_attn.q_proj.weight"))
    assert q.kind == "cast" and q.obstacle == Obstacle.DTYPE and q.shard_dim == 0
    assert q.vllm_copy_bytes == 32 * 64 * 2  # its 32-row slice in vLLM's bf16
    down = next(p for p in plan.params if p.name.endswith("0.mlp.down_proj.weight"))
    assert down.kind == "cast" and down.shard_dim == 1


def test_peft_model_base_weights_shared_lora_factors_default():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny(), LoraConfig(r=4, target_modules=["q_proj", "o_proj", "down_proj"]))
    plan = plan_model(model, 2)
    by_name = {p.name: p for p in plan.params}
    q = by_name["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    o = by_name["base_model.model.model.layers.0.self_attn.o_proj.base_layer.weight"]
    assert (q.kind, q.shard_dim, q.vllm_name) == ("shared", 0, "model.layers.0.self_attn.qkv_proj.weight")
    assert (o.kind, o.shard_dim) == ("shared", 1)
    adapters = plan.of_kind("adapter")
    assert len(adapters) == 2 * 3 * 2 and all(p.shard_dim == 0 for p in adapters)


def test_placement_fn_finds_parameters_by_identity_and_follows_replacements():
    model = tiny()
    fn = shard_placement_fn(model, 2)
    down = model.model.layers[1].mlp.down_proj
    assert fn(down.weight) == Shard(1)
    assert fn(model.model.layers[0].self_attn.k_proj.weight) == Shard(0)
    down.weight = torch.nn.Parameter(torch.zeros_like(down.weight))  # as model.to("meta") makes new parameters
    assert fn(down.weight) == Shard(1)
    assert fn(torch.nn.Parameter(torch.zeros(3))) is None and fn.unplanned == ["<unnamed (3,)>"]


def test_tied_embeddings_planned_once():
    model = tiny(tie_word_embeddings=True)
    plan = plan_model(model, 2)
    names = [p.name for p in plan.params]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert ShardPlacementFn(model, plan)(model.lm_head.weight) == Shard(0)


def test_torch_has_shard_placement_fn():
    assert fully_shard_takes_placement_fn()
