"""fp8 sampling under full fine-tuning, on CPU with vLLM's layout stood in: the 16-bit embeddings, norms and LM head
become vLLM's tensors while the linear weights stay the trainer's, the fp8 copy is the quantization of the trained
weights as they are at each write (after every optimizer step), nothing trained is parked, the sync still writes
what vLLM keeps a copy of, and what cannot serve is refused before the model loads. Under FSDP2 each rank writes its
copy from its own shards (`tests/sharding/test_adopt.py`)."""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch
from helpers import StandInVllmModel

from trl_turbo.ops.merge_fp8 import FP8_DTYPE, MergedShard, reference_merged_fp8
from trl_turbo.testing.models import tiny_model
from trl_turbo.testing.tokenizer import VOCAB
from trl_turbo.vllm import engine as vllm_engine
from trl_turbo.vllm.fp8 import Fp8Sampling, Fp8Tensor
from trl_turbo.vllm.weight_views import vllm_weight_name

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def _engine(monkeypatch):
    """A bf16 model trained whole and vLLM's stand-in with fp8 tensors in place of its decoder layers' matrices."""
    model = tiny_model("llama", vocab_size=len(VOCAB), dtype=torch.bfloat16, tie_word_embeddings=False)
    stand_in = StandInVllmModel(model)
    monkeypatch.setattr(vllm_engine, "driver_model", lambda llm: stand_in)
    fp8 = {vllm_weight_name(name): Fp8Tensor(torch.zeros(param.shape, dtype=FP8_DTYPE), torch.zeros(1))
           for name, param in stand_in.named_parameters() if param.dim() == 2 and ".layers." in name}
    return model, stand_in, fp8


def _expected_rows(model, layer: int, group: str, fused: str) -> torch.Tensor:
    modules = getattr(model.model.layers[layer], group)
    shards, start = [], 0
    for name in PACKED.get(fused, [fused]):
        weight = getattr(modules, name).weight.detach()
        shards.append(MergedShard(weight, None, None, 1.0, start))
        start += weight.shape[0]
    return reference_merged_fp8(shards, start)[0]


def test_the_fp8_copy_is_written_from_the_trained_weights_after_every_step(monkeypatch):
    model, stand_in, fp8 = _engine(monkeypatch)
    copies = vllm_engine.share_trained_parameters(object(), model, fp8=fp8)
    storages = {p.untyped_storage().data_ptr() for _, p in stand_in.named_parameters()}
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head}
    for name, param in model.named_parameters():
        # the 16-bit tensors are vLLM's (the optimizer writes what it samples); the linear weights stay the trainer's
        assert (param.untyped_storage().data_ptr() in storages) == (id(param) not in linear), name
    assert copies.casts == [] and copies.shared_bytes > 0
    views = vllm_engine.plan_views(object(), model, fp8, weights=vllm_engine.trained_parameters(model))[2]
    sampling = Fp8Sampling(model, None, fp8, views, torch.bfloat16)
    assert len(sampling.matrices) == len(fp8)
    for step in range(2):
        sampling.write()
        for layer in range(len(model.model.layers)):
            for group, fused in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
                                 ("mlp", "down_proj")):
                rows = fp8[f"model.layers.{layer}.{group}.{fused}.weight"].rows
                expected = _expected_rows(model, layer, group, fused)
                assert torch.equal(rows.view(torch.uint8), expected.view(torch.uint8)), (step, layer, fused)
        with torch.no_grad():  # an optimizer step: the next write must see it
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.1)


def test_trained_weights_are_never_parked():
    model = tiny_model("llama", vocab_size=len(VOCAB), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="only a frozen base is parked"):
        Fp8Sampling(model, None, {}, [], torch.bfloat16, park_base=True)


def test_the_engine_plan_of_full_finetuning_with_fp8(monkeypatch):
    from trl_turbo.config import Settings
    from trl_turbo.vllm import engine_plan

    model = tiny_model("llama", vocab_size=len(VOCAB), dtype=torch.bfloat16)
    config = types.SimpleNamespace(turbo_vllm_shared_weights=True, turbo_vllm_standby=True,
                                   turbo_vllm_kv_cache_dtype="auto", turbo_vllm_sampling="fp8")
    facts = engine_plan.engine_facts(model, host_bytes=1 << 40)
    plan = engine_plan.plan_engine(Settings.of(config), facts)
    assert plan.full_finetuning and plan.sampling == "fp8" and not plan.fp8_parks_base
    assert not plan.parks_while_starting
    auto = engine_plan.plan_engine(Settings.of(types.SimpleNamespace(**{**vars(config),
                                                                         "turbo_vllm_sampling": "auto"})), facts)
    assert auto.full_finetuning and auto.sampling is None
    # the KV budget's count of vLLM's weights: a 16-bit copy of every parameter, the fp8 linear weights 1 byte each
    from trl_turbo.vllm.fp8 import quantized_linear_modules
    from trl_turbo.vllm.sharing import Sharing

    every = sum(p.numel() for p in model.parameters())
    linear = sum(m.weight.numel() for m in quantized_linear_modules(model))
    assert engine_plan._vllm_weight_bytes(model, Sharing(), None) == 2 * every
    assert engine_plan._vllm_weight_bytes(model, Sharing(), "fp8") == 2 * every - linear
    sharded = engine_plan.plan_engine(Settings.of(config), facts, fsdp2=True, tp_size=2)
    assert sharded.sharded and sharded.full_finetuning and sharded.sampling == "fp8" and not sharded.fp8_parks_base


def test_full_finetuning_takes_fp8_and_refuses_the_adapter_modes_before_loading(monkeypatch):
    from trl_turbo import checks
    from trl_turbo.distributed import Strategy

    monkeypatch.setattr(checks.versions, "importable", lambda name: True)
    monkeypatch.setattr(checks, "fp8_capability", lambda: (9, 0))
    model = tiny_model("llama", vocab_size=len(VOCAB), dtype=torch.bfloat16)

    def config(sampling):
        return types.SimpleNamespace(use_vllm=True, turbo_vllm_shared_weights=True, turbo_vllm_sampling=sampling,
                                     model_init_kwargs=None)

    checks.check_trainer_inputs(config("fp8"), model, None)
    checks.check_trainer_inputs(config("auto"), model, None)
    for mode in ("merged", "lora"):
        with pytest.raises(ValueError, match="LoRA adapter reaches vLLM.*'fp8'"):
            checks.check_trainer_inputs(config(mode), model, None)
    monkeypatch.setattr(checks, "fp8_capability", lambda: (8, 0))
    with pytest.raises(ValueError, match="compute capability 8.9.*turbo_vllm_sampling='auto'"):
        checks.check_trainer_inputs(config("fp8"), model, None)
    monkeypatch.setattr(checks, "fp8_capability", lambda: (9, 0))
    monkeypatch.setattr(checks, "detect_strategy", lambda args: Strategy.FSDP2)
    checks.check_trainer_inputs(config("fp8"), model, None)  # each rank writes its copy from its own shards


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="needs an fp8 GPU")
def test_a_full_finetuning_run_samples_an_fp8_copy_of_the_weights_it_trains(tmp_path):
    """A GRPOTrainer training every weight with fp8 sampling: vLLM's 16-bit tensors are the trainer's embeddings,
    norms and LM head, the linear weights stay the trainer's, a copy is written every step, and after training vLLM
    samples the trained policy (log-probs near the trained model's, far from the initial one's)."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from trl_turbo.testing import vllm_checks
    from trl_turbo.vllm.engine_plan import engine_state

    trainer = vllm_checks.build_trainer("llama", tmp_path, steps=8, completion_cap=16, lora=False,
                                        turbo_vllm_sampling="fp8", turbo_vllm_kv_cache_dtype="fp8",
                                        vllm_importance_sampling_mode="token_truncate")
    state = engine_state(trainer.vllm_generation)
    assert vllm_checks.sampling_mode(trainer) == "fp8" and state.full_finetuning
    spans = vllm_checks.vllm_storage_spans(trainer.vllm_generation.llm)
    model = trainer.model
    inside = {name: any(start <= p.data_ptr() < stop for start, stop in spans) for name, p in model.named_parameters()}
    linear = {f"{name}.weight" for name, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and m is not model.lm_head}
    assert all(inside[name] != (name in linear) for name in inside), inside
    trainer.train()
    logs = [log for log in trainer.state.log_history if "vllm/quantize_s" in log]
    assert len(logs) == 8 and not any("vllm/parked_host_gib" in log for log in logs)

    token_ids = [[3 + (7 * i + j) % (len(VOCAB) - 3) for j in range(10)] for i in range(8)]
    outputs = vllm_checks.engine_generate(trainer, token_ids, SamplingParams(
        temperature=1.0, max_tokens=8, logprobs=0, ignore_eos=True, seed=0))
    initial = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16).to(model.device)
    gaps = {"trained": [], "initial": []}
    model.eval()
    with torch.no_grad():
        for prompt, output in zip(token_ids, outputs):
            completion = list(output.outputs[0].token_ids)
            sampled = torch.tensor([lp[t].logprob for lp, t in zip(output.outputs[0].logprobs, completion)])
            ids = torch.tensor([prompt + completion], device=model.device)
            for name, scorer in (("trained", model), ("initial", initial)):
                logps = scorer(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
                hf = logps.gather(-1, ids[0, len(prompt):, None]).squeeze(-1).cpu()
                gaps[name].append((hf - sampled).abs().mean())
    trained, start = float(torch.stack(gaps["trained"]).mean()), float(torch.stack(gaps["initial"]).mean())
    print({"gap_to_trained": trained, "gap_to_initial": start})
    assert start > 2 * trained, (trained, start)
