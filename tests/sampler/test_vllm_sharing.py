"""CPU side of the shared-weights vLLM engine: HF ↔ vLLM layout planning, sharing against a stand-in vLLM model,
the adapter as vLLM takes it, the KV budget, and config/trainer-input validation."""

from __future__ import annotations

import types

import pytest
import torch
from helpers import PACKED, StandInVllmModel

from trl_turbo.testing.models import ARCHITECTURES, tiny_model
from trl_turbo.testing.tokenizer import VOCAB
from trl_turbo.vllm import engine as vllm_engine
from trl_turbo.vllm.adapter import adapter_problems, adapter_tensors, lora_engine_kwargs
from trl_turbo.vllm.kv_budget import (
    PROMPT_ALLOWANCE_TOKENS,
    auto_kv_cache_bytes,
    expected_seq_len,
    kv_bytes_per_token,
    kv_margin_bytes,
    sampling_workspace_bytes,
    useful_kv_cache_bytes,
)
from trl_turbo.vllm.weight_views import LayoutMismatch, plan_shared_views


def _hf_shapes(model):
    return {n: tuple(p.shape) for n, p in model.named_parameters() if p.dim() == 2}


def _stand_in_shapes(stand_in):
    return {n.replace(".base_layer", ""): tuple(p.shape) for n, p in stand_in.named_parameters()}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_plan_maps_every_matrix_to_rows_holding_its_values(monkeypatch, arch):
    model = tiny_model(arch, vocab_size=len(VOCAB), tie_word_embeddings=arch.startswith("gemma"))
    stand_in = StandInVllmModel(model)
    monkeypatch.setattr(vllm_engine, "driver_model", lambda llm: stand_in)
    vllm_engine.load_weights(object(), model.state_dict().items())
    views = plan_shared_views(_hf_shapes(model), _stand_in_shapes(stand_in), PACKED)
    params = {n.replace(".base_layer", ""): p for n, p in stand_in.named_parameters()}
    weights = dict(model.named_parameters())
    assert {v.hf_name for v in views} == set(_hf_shapes(model))
    for view in views:
        assert torch.equal(params[view.vllm_name][view.start : view.stop], weights[view.hf_name]), view


def test_plan_refuses_what_does_not_fit():
    model = tiny_model("llama", vocab_size=len(VOCAB))
    vllm_shapes = _stand_in_shapes(StandInVllmModel(model))
    hf_shapes = _hf_shapes(model)
    with pytest.raises(LayoutMismatch, match="has no parameter"):
        plan_shared_views({**hf_shapes, "model.extra.weight": (4, 4)}, vllm_shapes, PACKED)
    with pytest.raises(LayoutMismatch, match="does not fit"):
        plan_shared_views({**hf_shapes, "model.norm.weight": (4, 4)}, {**vllm_shapes, "model.norm.weight": (2, 4)},
                          PACKED)
    without_q = {n: s for n, s in hf_shapes.items() if "layers.0.self_attn.q_proj" not in n}
    with pytest.raises(LayoutMismatch, match="offset is unknown"):
        plan_shared_views(without_q, vllm_shapes, PACKED)


def _peft_model(arch="llama", dtype=torch.float32, tied=False):
    from peft import LoraConfig, get_peft_model

    model = tiny_model(arch, vocab_size=len(VOCAB), dtype=dtype, tie_word_embeddings=tied)
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, param in peft_model.named_parameters():  # a trained-looking adapter: B is zero at init
        if "lora_B" in name:
            param.data.normal_(0, 0.1)
    return peft_model


def _loss_and_lora_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_sharing_makes_frozen_weights_views_and_leaves_training_unchanged(monkeypatch, tied):
    model = _peft_model(tied=tied)
    ids = torch.randint(3, len(VOCAB), (2, 12), generator=torch.Generator().manual_seed(0))
    loss_before, grads_before = _loss_and_lora_grads(model, ids)
    stand_in = StandInVllmModel(model.get_base_model())
    monkeypatch.setattr(vllm_engine, "driver_model", lambda llm: stand_in)

    shared = vllm_engine.share_base_weights(object(), model)

    storages = {p.untyped_storage().data_ptr() for _, p in stand_in.named_parameters()}
    frozen = vllm_engine.frozen_matrix_weights(model.get_base_model())
    assert frozen and all(w.untyped_storage().data_ptr() in storages for w in frozen.values())
    assert shared == sum(w.numel() * w.element_size() for w in frozen.values())
    assert all(p.untyped_storage().data_ptr() not in storages for n, p in model.named_parameters() if "lora_" in n)
    loss_after, grads_after = _loss_and_lora_grads(model, ids)
    assert torch.equal(loss_before, loss_after)
    assert grads_before.keys() == grads_after.keys()
    for name in grads_before:
        assert torch.equal(grads_before[name], grads_after[name]), name


def test_parked_weights_are_shared_from_the_host(monkeypatch):
    # On a CPU-only machine home and host are the same device; the GPU run moves them for real (bench e2e init peak)
    model = _peft_model()
    ids = torch.randint(3, len(VOCAB), (2, 12), generator=torch.Generator().manual_seed(0))
    loss_before, _ = _loss_and_lora_grads(model, ids)
    parked = vllm_engine.ParkedWeights(model)
    assert parked.weights.keys() == vllm_engine.frozen_matrix_weights(model.get_base_model()).keys()
    assert all(w.device.type == "cpu" for w in parked.weights.values())
    stand_in = StandInVllmModel(model.get_base_model())
    monkeypatch.setattr(vllm_engine, "driver_model", lambda llm: stand_in)
    assert vllm_engine.share_base_weights(object(), model, parked) > 0
    parked.unpark()
    storages = {p.untyped_storage().data_ptr() for _, p in stand_in.named_parameters()}
    assert all(w.untyped_storage().data_ptr() in storages for w in parked.weights.values())
    assert torch.equal(_loss_and_lora_grads(model, ids)[0], loss_before)


@pytest.mark.gpu
def test_parking_releases_a_segment_that_the_remaining_tensors_pinned(monkeypatch):
    """As transformers loads a model (into one warmed-up segment, before any step has run): a tensor that stays on
    the device (here a 4 MiB buffer, as norms and block scales are in a large model) pins the segment, so without
    compaction the parked matrices' memory stays cached in torch's pool; with it the segment is released, and the
    remaining tensors are the same objects with the same values."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda", torch.cuda.current_device())

    def loaded_model():
        model = _peft_model()
        model.register_buffer("stays", torch.arange(2**20, dtype=torch.float32))  # > 1 MiB: the large pool
        values = {name: t.detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}
        torch.cuda.empty_cache()
        size = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        warm = torch.empty(size + 2**31, dtype=torch.uint8, device=device)  # one segment, larger than the limit
        del warm
        return model.to(device), values  # carved out of that segment

    model, _ = loaded_model()
    with monkeypatch.context() as patched:
        patched.setattr(vllm_engine, "compact_device_tensors", lambda model: None)
        with pytest.warns(RuntimeWarning, match="stays cached"):
            vllm_engine.ParkedWeights(model).unpark()
    assert vllm_engine.stranded_bytes([device]) > vllm_engine.STRANDED_BYTES_LIMIT  # the setup pins the segment
    del model
    model, values = loaded_model()
    tensors = dict([*model.named_parameters(), *model.named_buffers()])
    reserved = torch.cuda.memory_reserved(device)
    parked = vllm_engine.ParkedWeights(model)
    assert vllm_engine.stranded_bytes([device]) <= vllm_engine.STRANDED_BYTES_LIMIT
    assert torch.cuda.memory_reserved(device) <= reserved - 2**31 + 2**26  # the 2 GiB segment went (new ones: small)
    parked.unpark()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert tensor is tensors[name] and tensor.is_cuda and torch.equal(tensor.cpu(), values[name]), name
    ids = torch.randint(3, len(VOCAB), (2, 12), generator=torch.Generator().manual_seed(0)).to(device)
    assert torch.isfinite(_loss_and_lora_grads(model, ids)[0])


def test_sharing_refuses_a_layout_whose_values_differ(monkeypatch):
    model = _peft_model()
    swapped = {"qkv_proj": ["k_proj", "q_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    stand_in = StandInVllmModel(model.get_base_model(), shard_order=swapped)  # stores K before Q
    monkeypatch.setattr(vllm_engine, "driver_model", lambda llm: stand_in)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(LayoutMismatch, match="differ"):
        vllm_engine.share_base_weights(object(), model)
    for name, param in model.named_parameters():  # nothing was re-pointed
        assert torch.equal(param, before[name]), name


def test_sharing_refuses_a_dtype_mismatch(monkeypatch):
    model = _peft_model()
    stand_in = StandInVllmModel(model.get_base_model())
    for _, param in stand_in.named_parameters():
        param.data = param.data.to(torch.bfloat16)
    monkeypatch.setattr(vllm_engine, "driver_model", lambda llm: stand_in)
    with pytest.raises(LayoutMismatch, match="training precision"):
        vllm_engine.share_base_weights(object(), model)


# ---------------------------------------------------------------------------------------------------- adapter
def test_adapter_tensors_have_checkpoint_names_and_are_copies():
    model = _peft_model()
    tensors = adapter_tensors(model)
    lora_params = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(tensors) == len(lora_params) > 0
    assert all(n.startswith("base_model.model.") and n.endswith(("lora_A.weight", "lora_B.weight")) for n in tensors)
    assert not any(".default." in n for n in tensors)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    live = lora_params["base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"]
    assert torch.equal(tensors[name], live)
    tensors[name].mul_(2.0)  # what vLLM's packing does to lora_B
    assert not torch.equal(tensors[name], live)


def test_adapter_limits_are_named():
    from peft import LoraConfig

    assert adapter_problems(LoraConfig(r=16)) == []
    assert "DoRA" in " ".join(adapter_problems(LoraConfig(r=16, use_dora=True)))
    assert "biases" in " ".join(adapter_problems(LoraConfig(r=16, bias="lora_only")))
    assert "modules_to_save" in " ".join(adapter_problems(LoraConfig(r=16, modules_to_save=["lm_head"])))
    assert "rank 1024" in " ".join(adapter_problems(LoraConfig(r=1024)))
    assert lora_engine_kwargs(LoraConfig(r=16))["max_lora_rank"] == 16
    assert lora_engine_kwargs(LoraConfig(r=12))["max_lora_rank"] == 16
    assert lora_engine_kwargs(LoraConfig(r=8, rank_pattern={"q_proj": 40}))["max_lora_rank"] == 64


# ------------------------------------------------------------------------------------------------- KV budget
def test_kv_budget_is_what_is_left_after_persistent_memory():
    gib = 2**30
    common = {"total_bytes": 140 * gib, "vllm_weight_bytes": 15 * gib, "sampling_workspace_bytes": 2 * gib}
    budget = auto_kv_cache_bytes(free_bytes=120 * gib, trainable_params=40_000_000, useful_bytes=1 << 50, **common)
    margin = 0.05 * 140 * gib
    assert budget == int(120 * gib - 15 * gib - 40_000_000 * 12 - 2 * gib - margin)
    # with the optimizer's states on the host between steps, only the gradient stays: 8 bytes a parameter more
    on_host = auto_kv_cache_bytes(free_bytes=120 * gib, trainable_params=40_000_000, useful_bytes=1 << 50,
                                  states_on_host=True, **common)
    assert on_host == budget + 40_000_000 * 8
    assert auto_kv_cache_bytes(free_bytes=120 * gib, trainable_params=0, useful_bytes=gib, **common) == gib
    with pytest.raises(ValueError, match="Not enough device memory"):
        auto_kv_cache_bytes(free_bytes=20 * gib, trainable_params=0, useful_bytes=1 << 50, **common)
    # A mid-size device: 5% of 32 GiB is 1.6 GiB, so the 2 GiB floor of the margin applies
    mid = {"total_bytes": 32 * gib, "vllm_weight_bytes": 4 * gib, "sampling_workspace_bytes": gib}
    assert auto_kv_cache_bytes(free_bytes=12 * gib, trainable_params=0, useful_bytes=1 << 50, **mid) == 5 * gib
    # A small device (or a capped process): the floor is at most 10% of it, 1.6 GiB of 16, 0.5 GiB of 5
    small = {"total_bytes": 16 * gib, "vllm_weight_bytes": 4 * gib, "sampling_workspace_bytes": gib}
    assert auto_kv_cache_bytes(free_bytes=12 * gib, trainable_params=0, useful_bytes=1 << 50,
                               **small) == int(12 * gib - 4 * gib - gib - int(1.6 * gib))
    assert kv_margin_bytes(5 * gib) == int(0.5 * gib) and kv_margin_bytes(140 * gib) == int(7 * gib)


def test_sampling_workspace_counts_logits_of_sampled_rows_only():
    # vLLM computes logits for one row per sequence: 8 sequences of a 151,936-token vocabulary, three fp32 copies
    assert sampling_workspace_bytes(8, 151936, 1536) == 4096 * 16 * 1536 * 4 + 3 * 8 * 151936 * 4
    assert sampling_workspace_bytes(256, 151936, 1536) > sampling_workspace_bytes(8, 151936, 1536)



def test_useful_kv_follows_the_expected_sequence_length():
    # Llama-3.1-8B: 32 layers x 8 KV heads x 128 dims x K and V x bf16 = 128 KiB per token
    per_token = kv_bytes_per_token(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2)
    assert per_token == 128 * 1024
    # vllm_max_model_length set: every sequence may reach it
    seq_len = expected_seq_len(max_model_length=4160, max_completion_length=4096)
    # (4160 tokens are 260 pages of 16; one spare page per sequence and vLLM's reserved page)
    assert useful_kv_cache_bytes(max_num_seqs=8, seq_len=seq_len, max_model_len=4160,
                                 per_token_bytes=per_token) == (8 * 261 + 1) * 16 * per_token
    # a length that ends inside a page takes the whole page
    assert useful_kv_cache_bytes(max_num_seqs=8, seq_len=4161, max_model_len=8192,
                                 per_token_bytes=per_token) == (8 * 262 + 1) * 16 * per_token
    # unset: the completion cap plus a prompt allowance, not the model's 128K context ...
    seq_len = expected_seq_len(max_model_length=None, max_completion_length=4096)
    assert seq_len == 4096 + PROMPT_ALLOWANCE_TOKENS
    assert useful_kv_cache_bytes(max_num_seqs=64, seq_len=seq_len, max_model_len=131072,
                                 per_token_bytes=per_token) == (64 * (seq_len // 16 + 1) + 1) * 16 * per_token
    # ... but never less than one full-context sequence, without which vLLM refuses to start
    assert useful_kv_cache_bytes(max_num_seqs=8, seq_len=seq_len, max_model_len=131072,
                                 per_token_bytes=per_token) == (131072 // 16 + 1) * 16 * per_token
    # in whole pages, with vLLM's reserved one, where the context ends inside a page
    assert useful_kv_cache_bytes(max_num_seqs=1, seq_len=100, max_model_len=4097,
                                 per_token_bytes=per_token) == (257 + 1) * 16 * per_token


# ------------------------------------------------------------------------------------------------ validation
def _config(**kwargs):
    from trl import GRPOConfig

    return GRPOConfig(output_dir="unused", report_to="none", use_cpu=True, **kwargs)


def test_engine_switches_need_colocated_vllm():
    for switch in ("turbo_vllm_shared_weights", "turbo_vllm_standby"):
        with pytest.raises(ValueError, match="use_vllm=True"):
            _config(**{switch: True})
        with pytest.raises(ValueError, match="vllm_mode='colocate'"):
            _config(use_vllm=True, vllm_mode="server", **{switch: True})
    with pytest.raises(ValueError, match="vllm_enable_sleep_mode=False"):
        _config(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True, turbo_vllm_standby=True)
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size=1.*FSDP2"):
        _config(use_vllm=True, vllm_mode="colocate", vllm_tensor_parallel_size=2, turbo_vllm_shared_weights=True)
    with pytest.raises(ValueError, match="not one of"):
        _config(turbo_vllm_kv_cache_dtype="int4")


def test_engine_switches_name_the_vllm_they_need(monkeypatch):
    from trl_turbo import versions

    monkeypatch.setattr(versions, "installed_version", lambda package: "0.22.0" if package == "vllm" else None)
    with pytest.raises(ValueError, match=r"vllm==0.22.0.*supported: >=0.24.0,<0.32.0.*trl-turbo\[vllm\]"):
        _config(use_vllm=True, vllm_mode="colocate", turbo_vllm_standby=True)


def test_shared_weights_name_the_peft_they_need(monkeypatch):
    from trl_turbo import versions

    found = {"vllm": "0.24.0", "peft": "1.3.0"}
    monkeypatch.setattr(versions, "installed_version", found.get)
    with pytest.raises(ValueError, match=r"peft==1.3.0 \(supported: >=0.17.0,<1.0.0\)"):
        _config(use_vllm=True, vllm_mode="colocate", turbo_vllm_shared_weights=True)
    _config(use_vllm=True, vllm_mode="colocate", turbo_vllm_standby=True)  # standby alone reads no adapter
    found["peft"] = "0.21.0"
    _config(use_vllm=True, vllm_mode="colocate", turbo_vllm_shared_weights=True)


def test_trainer_inputs_that_cannot_share_are_refused_or_copied_before_loading(tmp_path):
    from peft import LoraConfig
    from transformers import AutoConfig, AutoModelForCausalLM

    from trl_turbo.checks import check_trainer_inputs

    config = types.SimpleNamespace(turbo_vllm_shared_weights=True, model_init_kwargs=None)
    llama = tiny_model("llama", vocab_size=len(VOCAB))
    check_trainer_inputs(config, llama, LoraConfig(r=8))
    check_trainer_inputs(config, llama, None)  # full fine-tuning: vLLM samples the trained parameters
    with pytest.raises(ValueError, match="turbo_vllm_sampling='merged'.*full|every weight"):
        check_trainer_inputs(types.SimpleNamespace(**vars(config), turbo_vllm_sampling="merged"), llama, None)
    with pytest.raises(ValueError, match="DoRA"):
        check_trainer_inputs(config, llama, LoraConfig(r=8, use_dora=True))
    # model types whose vLLM layout is not mapped: a separate copy in vLLM, with a warning
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=1, n_embd=16, n_head=2,
                                                                 vocab_size=len(VOCAB)))
    with pytest.warns(RuntimeWarning, match="'gpt2'.*separate 16-bit copy.*2 bytes per base parameter"):
        check_trainer_inputs(config, gpt2, LoraConfig(r=8))
    with pytest.raises(ValueError, match="full fine-tuning.*'gpt2'.*turbo_vllm_shared_weights=False"):
        check_trainer_inputs(config, gpt2, None)  # full fine-tuning of an unmapped family: no copy path
    AutoConfig.for_model("phi3", hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         vocab_size=len(VOCAB)).save_pretrained(tmp_path)
    with pytest.warns(RuntimeWarning, match="'phi3'.*separate 16-bit copy"):  # a checkpoint path, read before loading
        check_trainer_inputs(config, str(tmp_path), LoraConfig(r=8))
    check_trainer_inputs(types.SimpleNamespace(turbo_vllm_shared_weights=False), gpt2, None)  # switch off: no check
