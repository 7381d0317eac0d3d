"""fp8 sampling (`trl_turbo.vllm.fp8`), on CPU with stand-ins for vLLM's fp8 tensors: every fp8 matrix is written from
the training model's base weights and live adapter exactly as the fp32 reference quantizes them, the training model is
never written, an incomplete plan is refused, and the run is refused before the model loads where fp8 cannot serve."""

from __future__ import annotations

import types

import pytest
import torch
from helpers import as_if_vllm_installed, randomize_adapter
from peft import LoraConfig, get_peft_model

from trl_turbo.ops.merge_fp8 import MergedShard, reference_merged_fp8
from trl_turbo.testing.models import tiny_model
from trl_turbo.vllm.fp8 import Fp8Sampling, Fp8Tensor, hf_linear_modules
from trl_turbo.vllm.weight_views import LayoutMismatch, plan_shared_views

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def _lora_model(target_modules="all-linear", dtype=torch.bfloat16, model=None):
    model = model or tiny_model("llama", vocab_size=64, hidden_size=32, layers=2, dtype=dtype)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=target_modules))
    randomize_adapter(peft_model, seed=0, scale=0.3)
    return peft_model


def _stand_in_engine(peft_model, drop: str | None = None):
    """vLLM's fp8 linear tensors (fused q/k/v and gate/up, as its Llama packs them) and the plan's views onto them."""
    from trl_turbo.ops.merge_fp8 import FP8_DTYPE as fp8

    modules = hf_linear_modules(peft_model)
    hf_shapes = {name: tuple(m.weight.shape) if m.weight.dtype != torch.uint8 else tuple(m.weight.quant_state.shape)
                 for name, m in modules.items() if name != "lm_head.weight"}
    if drop is not None:
        hf_shapes.pop(drop)
    layers = {name.rsplit(".", 3)[0] for name in hf_shapes}  # model.layers.<i>
    fused = {}
    for layer in layers:
        for packed, shards in PACKED.items():
            group = "self_attn" if packed == "qkv_proj" else "mlp"
            rows = sum(modules[f"{layer}.{group}.{s}.weight"].out_features for s in shards)
            cols = modules[f"{layer}.{group}.{shards[0]}.weight"].in_features
            fused[f"{layer}.{group}.{packed}.weight"] = (rows, cols)
        for group, single in (("self_attn", "o_proj"), ("mlp", "down_proj")):
            module = modules[f"{layer}.{group}.{single}.weight"]
            fused[f"{layer}.{group}.{single}.weight"] = (module.out_features, module.in_features)
    tensors = {name: Fp8Tensor(torch.zeros(shape, dtype=fp8), torch.zeros(1)) for name, shape in fused.items()}
    views = plan_shared_views(hf_shapes, fused, PACKED)
    return tensors, views


def _expected(model, matrix_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 rows, scale) of vLLM's fused matrix `matrix_name` (`model.layers.<i>.<group>.<name>.weight`), computed
    here from PEFT's own modules, independently of `Fp8Sampling`: each HF matrix's base weight plus
    scaling * lora_B @ lora_A in fp32, stacked in vLLM's packing order, one per-tensor scale (amax / e4m3's max)."""
    from trl_turbo.ops.merge_fp8 import FP8_DTYPE, FP8_MAX

    _, _, index, group, fused_name, _ = matrix_name.split(".")
    modules = getattr(model.base_model.model.model.layers[int(index)], group)
    rows = []
    for name in PACKED.get(fused_name, [fused_name]):
        module = getattr(modules, name)
        if not hasattr(module, "lora_A"):
            rows.append(module.weight.detach().float())
            continue
        delta = module.lora_B["default"].weight.detach().float() @ module.lora_A["default"].weight.detach().float()
        rows.append(torch.add(module.base_layer.weight.detach().float(), delta, alpha=module.scaling["default"]))
    merged = torch.cat(rows)
    scale = merged.abs().max() / FP8_MAX
    return (merged / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def test_every_fp8_matrix_is_the_quantized_merge_and_the_trainer_weights_are_untouched():
    model = _lora_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tensors, views = _stand_in_engine(model)
    sampling = Fp8Sampling(model, "default", tensors, views, torch.bfloat16)
    assert len(sampling.matrices) == 2 * 4 and sampling.copy_bytes == sum(t.rows.numel() for t in tensors.values())
    sampling.write()
    for matrix in sampling.matrices:
        expected, scale = _expected(model, matrix.name)
        assert torch.equal(matrix.target.rows.view(torch.uint8), expected.view(torch.uint8)), matrix.name
        assert matrix.target.scale.item() == pytest.approx(scale.item(), rel=1e-6)
    qkv = sampling.matrices[[m.name for m in sampling.matrices].index("model.layers.0.self_attn.qkv_proj.weight")]
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    delta = q.lora_B["default"].weight @ q.lora_A["default"].weight
    merged_q = q.base_layer.weight.float() + q.scaling["default"] * delta
    dequantized = qkv.target.rows[: q.out_features].float() * qkv.target.scale
    assert (dequantized - merged_q).abs().max() <= merged_q.abs().max() / 8  # fp8 keeps 3 mantissa bits
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, before[name]), name
    metrics = sampling.take_metrics()
    assert metrics["vllm/quantize_s"] >= 0 and metrics["vllm/fp8_copy_gib"] > 0


def test_the_live_adapter_is_read_at_every_write():
    model = _lora_model()
    tensors, views = _stand_in_engine(model)
    sampling = Fp8Sampling(model, "default", tensors, views, torch.bfloat16)
    sampling.write()
    first = {name: t.rows.clone() for name, t in tensors.items()}
    randomize_adapter(model, seed=1, scale=0.3)  # an optimizer step
    sampling.write()
    for matrix in sampling.matrices:
        assert not torch.equal(first[matrix.name].view(torch.uint8), matrix.target.rows.view(torch.uint8))
        assert torch.equal(matrix.target.rows.view(torch.uint8), _expected(model, matrix.name)[0].view(torch.uint8))


def test_unadapted_layers_are_quantized_from_the_base_alone():
    model = _lora_model(target_modules=["q_proj", "v_proj"])
    tensors, views = _stand_in_engine(model)
    sampling = Fp8Sampling(model, "default", tensors, views, torch.bfloat16)
    sampling.write()
    down = next(m for m in sampling.matrices if m.name.endswith("layers.1.mlp.down_proj.weight"))
    assert down.shards[0].lora is None
    weight = model.base_model.model.model.layers[1].mlp.down_proj.weight
    expected, _ = reference_merged_fp8([MergedShard(weight.detach(), None, None, 1.0, 0)], weight.shape[0])
    assert torch.equal(down.target.rows.view(torch.uint8), expected.view(torch.uint8))


def test_a_plan_that_leaves_rows_unwritten_is_refused():
    model = _lora_model(target_modules=["q_proj"])
    tensors, views = _stand_in_engine(model)
    views = [v for v in views if v.hf_name != "model.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(LayoutMismatch, match="placeholder"):
        Fp8Sampling(model, "default", tensors, views, torch.bfloat16)


def test_an_adapter_on_a_layer_vllm_keeps_in_16_bits_is_refused():
    model = _lora_model(target_modules=["q_proj", "lm_head"])
    tensors, views = _stand_in_engine(model)
    with pytest.raises(LayoutMismatch, match="lm_head"):
        Fp8Sampling(model, "default", tensors, views, torch.bfloat16)


def test_4bit_base_weights_are_dequantized_one_matrix_at_a_time(tmp_path):
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import dequantize_4bit
    from helpers import quantized_peft_model

    model = quantized_peft_model(tmp_path, load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                 bnb_4bit_compute_dtype=torch.bfloat16)
    randomize_adapter(model, seed=2, scale=0.3)
    tensors, views = _stand_in_engine(model)
    sampling = Fp8Sampling(model, "default", tensors, views, torch.bfloat16)
    sampling.write()
    o_proj = model.base_model.model.model.layers[0].self_attn.o_proj
    matrix = next(m for m in sampling.matrices if m.name == "model.layers.0.self_attn.o_proj.weight")
    base = dequantize_4bit(o_proj.base_layer.weight.data, o_proj.base_layer.weight.quant_state).to(torch.bfloat16)
    shard = MergedShard(base, o_proj.lora_B["default"].weight.detach(), o_proj.lora_A["default"].weight.detach(),
                        float(o_proj.scaling["default"]), 0)
    assert torch.equal(matrix.target.rows.view(torch.uint8),
                       reference_merged_fp8([shard], base.shape[0])[0].view(torch.uint8))


# ------------------------------------------------------------------------------- refused before the model loads
def test_fp8_problems_name_what_stands_against_it():
    from trl_turbo.checks import fp8_problems

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    assert fp8_problems([], lora, (9, 0)) == []
    assert any("8.9" in p and "8.0" in p for p in fp8_problems([], lora, (8, 0)))
    assert any("8.9" in p for p in fp8_problems([], lora, None))
    assert any("8-bit" in p for p in fp8_problems(["8-bit layers"], lora, (9, 0)))
    embedded = LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"])
    assert any("embed_tokens" in p for p in fp8_problems([], embedded, (9, 0)))
    saved = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    assert any("lm_head" in p for p in fp8_problems([], saved, (9, 0)))


def test_fp8_needs_importance_sampling_and_shared_weights(tmp_path, monkeypatch):
    from trl import GRPOConfig

    import trl_turbo  # noqa: F401


    common = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, use_vllm=True, vllm_mode="colocate")
    with pytest.raises(ValueError, match="vllm_importance_sampling_correction=True"):
        GRPOConfig(**common, turbo_vllm_shared_weights=True, turbo_vllm_sampling="fp8",
                   vllm_importance_sampling_correction=False)
    with pytest.raises(ValueError, match="turbo_vllm_shared_weights=True"):
        GRPOConfig(**common, turbo_vllm_sampling="fp8")
    as_if_vllm_installed(monkeypatch)
    for product_mode in ("sequence_mask", "sequence_truncate"):  # sequence_mask is TRL's default
        with pytest.raises(ValueError, match=f"vllm_importance_sampling_mode='{product_mode}'.*token_truncate"):
            GRPOConfig(**common, turbo_vllm_shared_weights=True, turbo_vllm_sampling="fp8",
                       vllm_importance_sampling_mode=product_mode)
    for mode in ("token_truncate", "token_mask", "sequence_geometric_mask", "sequence_geometric_truncate"):
        config = GRPOConfig(**common, turbo_vllm_shared_weights=True, turbo_vllm_sampling="fp8",
                            vllm_importance_sampling_mode=mode)
        assert config.turbo_vllm_sampling == "fp8"


def test_trainer_inputs_without_an_fp8_gpu_are_refused_before_loading(monkeypatch):
    from trl_turbo import checks

    monkeypatch.setattr(checks.versions, "importable", lambda name: True)
    monkeypatch.setattr(checks, "fp8_capability", lambda: (8, 0))
    config = types.SimpleNamespace(use_vllm=True, turbo_vllm_shared_weights=True, turbo_vllm_sampling="fp8",
                                   model_init_kwargs=None)
    model = tiny_model("llama", vocab_size=64, hidden_size=32, layers=1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="compute capability 8.9"):
        checks.check_trainer_inputs(config, model, LoraConfig(r=4, target_modules="all-linear"))
    monkeypatch.setattr(checks, "fp8_capability", lambda: (9, 0))
    checks.check_trainer_inputs(config, model, LoraConfig(r=4, target_modules="all-linear"))


def test_the_fp8_engine_quantizes_online_without_lora_slots():
    from trl_turbo.config import Settings
    from trl_turbo.vllm import engine_plan
    from trl_turbo.vllm.sharing import Sharing

    model = _lora_model()
    generation = types.SimpleNamespace(mode="colocate", model=model, accelerator=types.SimpleNamespace(
        mixed_precision="bf16", device=torch.device("cpu")), max_num_seqs=8, max_model_length=512,
        max_completion_length=64)
    config = types.SimpleNamespace(turbo_vllm_shared_weights=True, turbo_vllm_standby=False,
                                   turbo_vllm_kv_cache_dtype="fp8", turbo_vllm_sampling="fp8")
    settings = Settings.of(config)
    assert engine_plan.plan_engine(settings, engine_plan.engine_facts(model)).sampling == "fp8"
    kwargs = engine_plan.engine_kwargs(generation, config, Sharing(), "fp8")
    assert kwargs["quantization"] == "fp8" and kwargs["load_format"] == "dummy" and "enable_lora" not in kwargs
    assert kwargs["kv_cache_dtype"] == "fp8" and kwargs["dtype"] == "bfloat16"
    # the engine starts while the frozen weights wait on the host; afterwards the device holds 1 byte per linear
    # weight of fp8 copy plus every frozen weight back (the 16-bit ones as vLLM's shared tensors or the model's own)
    head = model.get_output_embeddings()
    linear = sum(m.weight.numel() for m in hf_linear_modules(model).values() if m is not head)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    assert engine_plan._vllm_weight_bytes(model, Sharing(), "fp8") == linear + frozen


def test_generation_writes_the_fp8_copy_first_and_never_touches_the_trainer(monkeypatch):
    from trl_turbo.patches import trl_vllm
    from trl_turbo.vllm import engine_plan

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1, 2))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    model = _lora_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tensors, views = _stand_in_engine(model)
    state = engine_plan.EngineState()
    state.fp8 = Fp8Sampling(model, "default", tensors, views, torch.bfloat16, park_base=True, pin=False)
    modules = [shard.module for m in state.fp8.matrices for shard in m.shards]
    resets = []
    llm = types.SimpleNamespace(reset_prefix_cache=lambda: resets.append(1))
    generation = types.SimpleNamespace(_trl_turbo_engine=state, llm=llm,
                                       accelerator=types.SimpleNamespace(device=torch.device("cpu")))
    seen = []

    def trl_generate(self, prompts):
        seen.append(bool(next(iter(tensors.values())).rows.float().abs().sum() > 0))  # written before sampling
        seen.append(all(m.weight.numel() == 0 for m in modules))  # the 16-bit weights are parked meanwhile
        raise RuntimeError("vLLM failed")

    with pytest.raises(RuntimeError):
        trl_vllm._wrap_generate(trl_generate)(generation, [[1]])
    assert seen == [True, True] and resets == [1]  # the prefix cache was computed with the previous copy
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, before[name]), name
    assert "vllm/quantize_s" in engine_plan.drain_metrics(generation)
    sync = trl_vllm._wrap_sync_weights(lambda self: pytest.fail("TRL's full-weight push must not run"))
    assert sync(generation) is None


# ------------------------------------------------------------------- 16-bit weights parked while vLLM samples
def test_parked_weights_leave_the_device_and_come_back_bit_for_bit():
    model = _lora_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.no_grad():
        logits = model(ids).logits
    tensors, views = _stand_in_engine(model)
    sampling = Fp8Sampling(model, "default", tensors, views, torch.bfloat16, park_base=True, pin=False)
    assert sampling.parked_host_bytes >= sum(m.weight.numel() * 2 for s in sampling.matrices for m in
                                             (shard.module for shard in s.shards))
    copies = {n: Fp8Tensor(t.rows.clone(), t.scale.clone()) for n, t in tensors.items()}
    unparked = Fp8Sampling(model, "default", copies,
                           views, torch.bfloat16)
    unparked.write()
    sampling.write()
    modules = [shard.module for m in sampling.matrices for shard in m.shards]
    assert all(m.weight.numel() == 0 for m in modules)  # off the device while vLLM samples
    for matrix, reference in zip(sampling.matrices, unparked.matrices):  # written from the weights before they left
        assert torch.equal(matrix.target.rows.view(torch.uint8), reference.target.rows.view(torch.uint8))
    sampling.unpark()
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, before[name]), name
    sampling.write()  # parked again; anything reaching the model brings them back first
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)
    sampling.write()
    state = model.state_dict()
    assert all(state[name].shape == before[name].shape for name in before)
    assert sampling.take_metrics()["vllm/parked_host_gib"] > 0
    sampling.close()


def test_fp8_parks_16_bit_weights_when_the_host_copy_fits(monkeypatch, tmp_path):
    from trl_turbo.config import Settings
    from trl_turbo.vllm import engine_plan

    model = _lora_model()
    settings = Settings.of(types.SimpleNamespace(turbo_vllm_shared_weights=True, turbo_vllm_sampling="fp8"))

    def fp8_parks_base() -> bool:  # as the engine decides once it has started (the plan forecasts the same)
        parks, problem = engine_plan.fp8_parking(engine_plan.engine_facts(model))
        assert engine_plan.plan_engine(settings, engine_plan.engine_facts(model)).fp8_parks_base is parks
        engine_plan.warn_fp8_parking(problem)
        return parks

    monkeypatch.setattr(engine_plan, "available_host_bytes", lambda: 64 * 2**30)
    assert fp8_parks_base()
    monkeypatch.setattr(engine_plan, "available_host_bytes", lambda: 2**10)
    with pytest.warns(RuntimeWarning, match="keeps the 16-bit base weights on the device"):
        assert not fp8_parks_base()


def test_each_fp8_tensor_is_mapped_just_before_it_is_written_while_the_base_leaves(monkeypatch):
    """With a standby, the fp8 copy's memory comes back one tensor at a time, each just before it is written, while
    the 16-bit weights already written from go to the host: the device never holds both copies whole."""
    from trl_turbo.vllm import session

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1, 2))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)

    model = _lora_model()
    tensors, views = _stand_in_engine(model)
    sampling = Fp8Sampling(model, "default", tensors, views, torch.bfloat16, park_base=True, pin=False)
    names = {id(t.rows): name for name, t in tensors.items()}
    events = []

    class Standby:
        released, weight_releases = True, 0

        def restore_weights(self, only=None):
            (rows,) = only
            parked = [m.name for m in sampling.matrices if all(s.module.weight.numel() == 0 for s in m.shards)]
            events.append((names[id(rows)], parked))

        def restore(self):
            events.append("kv")
            self.released = False
            return 0

        def release(self):
            if not self.released:
                events.append("release")
            self.released = True
            return 0

    # under FSDP2 the shards are put back in place first: fp8 is written from them and parks them
    state = types.SimpleNamespace(merged=None, fp8=sampling, standby=Standby(), weight_copies=None, metrics={},
                                  before_sampling=lambda: events.append("reshard"))
    llm = types.SimpleNamespace(reset_prefix_cache=lambda: None)
    with session.generating(llm, state, torch.device("cpu")):
        events.append("generate")
    assert events.pop(0) == "reshard"
    order = [m.name for m in sampling.matrices]
    assert [name for name, _ in events[:-3]] == order  # each once, in the order written, before the KV cache
    for index, (_, parked) in enumerate(events[:-3]):
        assert parked == order[:index]  # the ones written before it have left the device, it has not
    assert events[-3:] == ["kv", "generate", "release"]
    assert all(m.weight.numel() > 0 for m in (s.module for m in sampling.matrices for s in m.shards))  # back after
    sampling.close()
