"""The engine plan when FSDP2 shards the training model and vLLM runs tensor-parallel (pure; the sharing itself is
tests/sharding/test_adopt.py on CPU and tests/integration/test_multi_gpu.py on 2 GPUs)."""

from __future__ import annotations

import types

import pytest
import torch
from peft import LoraConfig, get_peft_model

from trl_turbo.config import Settings
from trl_turbo.testing.models import tiny_model
from trl_turbo.vllm import engine_plan
from trl_turbo.vllm.sharing import Sharing


def _lora_model(**shape):
    model = tiny_model("llama", vocab_size=128, dtype=torch.bfloat16, **shape)
    return get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))


def _settings(**fields):
    return Settings.of(types.SimpleNamespace(turbo_vllm_shared_weights=True, turbo_vllm_standby=True, **fields))


def test_fsdp2_engine_merges_into_the_shards_where_every_adapted_one_is_vllm_memory():
    from trl_turbo.sharding.shard_placement import unshared_adapted_weights

    model = _lora_model(num_attention_heads=4, num_key_value_heads=2)
    facts = engine_plan.engine_facts(model)
    whole = engine_plan.plan_engine(_settings(), facts)
    assert whole.sampling == "merged" and whole.parks_while_starting and not whole.sharded
    assert unshared_adapted_weights(model, 2) == []
    sharded = engine_plan.plan_engine(_settings(), facts, tp_size=2, fsdp2=True)
    assert sharded.sharded and sharded.tp_size == 2 and sharded.shares_weights and sharded.sampling == "merged"
    assert not sharded.parks_while_starting  # the model waits on the host until FSDP2 wraps it
    # T=4 > 2 KV heads: vLLM replicates k/v, whose FSDP2 shards then keep a copy of their own: no merge into them
    unshared = unshared_adapted_weights(model, 4)
    assert unshared and all(".k_proj." in name or ".v_proj." in name for name in unshared)
    replicated = engine_plan.plan_engine(_settings(), facts, tp_size=4, fsdp2=True, unshared_adapted=unshared)
    assert replicated.sampling == "lora" and "copy of their own" in replicated.sampling_problems[-1]


def test_fsdp2_refuses_a_model_that_would_need_a_separate_copy():
    facts = engine_plan.engine_facts(_lora_model())
    facts = types.SimpleNamespace(**{**facts.__dict__, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="under FSDP2 shares tensor-parallel slices.*gpt2"):
        engine_plan.plan_engine(_settings(), facts, tp_size=2, fsdp2=True)


def test_kv_budget_counts_a_tensor_parallel_slice_and_fsdp_shards(monkeypatch):
    counted = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100 * 2**30, 140 * 2**30))
    monkeypatch.setattr(engine_plan, "auto_kv_cache_bytes", lambda **kw: counted.append(kw) or 0)
    model = _lora_model()
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    def budget(tp, processes, **flags):
        generation = types.SimpleNamespace(
            mode="colocate", model=model, tensor_parallel_size=tp, max_num_seqs=8, max_model_length=512,
            max_completion_length=64, accelerator=types.SimpleNamespace(
                mixed_precision="bf16", device=torch.device("cpu"), num_processes=processes))
        engine_plan.kv_budget(generation, Sharing(), "auto", "lora", **flags)
        return counted[-1]["vllm_weight_bytes"], counted[-1]["trainable_params"]

    assert budget(1, 1) == (frozen, trainable)  # one GPU: the engine's weights are the model's, parked meanwhile
    # FSDP2 + TP=2 over 2 ranks: vLLM's half of the weights, which FSDP2's frozen shards become; half the adapter
    # (its fp32 masters arrive with FSDP2, its gradients and Adam moments are counted per parameter)
    assert budget(2, 2, sharded=True, fsdp=True) == (frozen // 2 + trainable * 4 // 2, -(-trainable // 2))
    # standby alone under FSDP: vLLM's half, and FSDP2's own quarter of the frozen weights over 4 ranks
    assert budget(2, 4, fsdp=True) == (frozen // 2 + frozen // 4 + trainable, -(-trainable // 4))


def test_kv_budget_sizes_a_rank_cache_for_the_sequences_it_is_handed(monkeypatch):
    """Per rank: its KV heads (half of them at T=2), for the sequences of one generation (a rank's share of TRL's
    global generation batch, times the T ranks whose prompts TRL gathers), not vLLM's 256-sequence default."""
    counted = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100 * 2**30, 140 * 2**30))
    monkeypatch.setattr(engine_plan, "auto_kv_cache_bytes", lambda **kw: counted.append(kw) or 0)
    model = _lora_model(num_key_value_heads=2, num_attention_heads=4)

    def useful(tp, processes, batch):
        generation = types.SimpleNamespace(
            mode="colocate", model=model, tensor_parallel_size=tp, max_num_seqs=None, max_model_length=512,
            max_completion_length=64, accelerator=types.SimpleNamespace(
                mixed_precision="bf16", device=torch.device("cpu"), num_processes=processes))
        sequences = engine_plan.sequences_per_generation(generation, types.SimpleNamespace(generation_batch_size=batch))
        engine_plan.kv_budget(generation, Sharing(), "auto", "lora", sequences=sequences)
        return sequences, counted[-1]["useful_bytes"]

    one_gpu = useful(1, 1, 64)
    assert one_gpu[0] == 64
    # twice the sequences, half the heads each: twice the pages of 64 + 512 tokens (33 with the spare), half as large
    # (both caches keep vLLM's one reserved page)
    page = one_gpu[1] // (64 * 33 + 1)
    assert one_gpu[1] == (64 * 33 + 1) * page
    assert useful(2, 2, 128) == (128, (128 * 33 + 1) * page // 2)
    assert useful(1, 2, 128) == one_gpu  # DDP: a rank's own 64
    assert useful(1, 1, 1024)[0] == 1024 and useful(1, 1, 1024)[1] == useful(1, 1, 256)[1]  # vLLM schedules 256


def test_merged_sampling_under_fsdp2_needs_a_host_copy_of_each_rank_slices_only():
    """Four processes on a host with room for 1.5 whole copies of the adapted matrices: one process each with a
    whole copy would not fit (lora); four ranks each with a quarter, a whole copy in all, do (merged)."""
    facts = engine_plan.engine_facts(_lora_model(num_attention_heads=4, num_key_value_heads=4))
    facts = types.SimpleNamespace(**{**facts.__dict__, "processes_on_host": 4,
                                     "host_bytes": 3 * facts.adapted_weight_bytes})
    whole = engine_plan.plan_engine(_settings(), facts)
    assert whole.sampling == "lora" and "host copy" in whole.sampling_problems[0]
    sharded = engine_plan.plan_engine(_settings(), facts, tp_size=4, fsdp2=True)
    assert sharded.sampling == "merged" and sharded.sampling_problems == ()


def test_fsdp2_fp8_sampling_writes_per_shard_and_refuses_projections_laid_out_otherwise():
    from trl_turbo.sharding.shard_placement import unshared_projection_weights

    model = _lora_model(num_attention_heads=4, num_key_value_heads=2)
    facts = engine_plan.engine_facts(model)
    fp8 = _settings(turbo_vllm_sampling="fp8")
    assert unshared_projection_weights(model, 2) == []
    sharded = engine_plan.plan_engine(fp8, facts, tp_size=2, fsdp2=True)
    assert sharded.sharded and sharded.sampling == "fp8" and not sharded.parks_while_starting
    # parking is judged by each rank's host copy of its own slices: a host too small for the whole model's linear
    # weights but big enough for one slice of them parks
    linear = facts.linear_weight_bytes
    small_host = types.SimpleNamespace(**{**facts.__dict__, "host_bytes": 2 * linear * facts.processes_on_host - 1})
    parks, problem = engine_plan.fp8_parking(small_host)
    assert not parks and problem is not None
    assert engine_plan.fp8_parking(small_host, shards=2) == (True, None)
    # T=4 > 2 KV heads: vLLM replicates k/v, so FSDP2's shards of them are not its slices; every other projection is
    unshared = unshared_projection_weights(model, 4)
    assert unshared and all(".k_proj." in name or ".v_proj." in name for name in unshared)
    with pytest.raises(ValueError, match="fp8.*under FSDP2.*k_proj.*'merged'.*'lora'"):
        engine_plan.plan_engine(fp8, facts, tp_size=4, fsdp2=True, unshared_projections=unshared)
