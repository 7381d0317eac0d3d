"""Merged sampling from shared weights (`trl_turbo.vllm.merge`), on CPU: the merge is W + scaling*B@A rounded once,
and the restore gives back the base weights bit for bit, over many cycles, on every way out of a generation."""

from __future__ import annotations

import pytest
import torch
from helpers import randomize_adapter
from peft import LoraConfig, get_peft_model

from trl_turbo.testing.models import tiny_model
from trl_turbo.testing.tolerance import assert_within_naive_error
from trl_turbo.vllm.merge import MergedSampling, host_copy_problem, lora_targets, merge_into, merge_problems


def _lora_model(dtype: torch.dtype, seed: int = 0, **lora: object):
    model = tiny_model("llama", vocab_size=64, hidden_size=32, layers=2, dtype=dtype, seed=seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **lora)
    peft_model = get_peft_model(model, config)
    randomize_adapter(peft_model, seed)
    return peft_model


def _base_weights(peft_model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in peft_model.named_parameters() if not p.requires_grad}


def _assert_bitwise_equal(model, reference: dict[str, torch.Tensor]) -> None:
    for name, parameter in model.named_parameters():
        if name in reference:
            bits = torch.int16 if parameter.element_size() == 2 else torch.int32
            assert torch.equal(parameter.detach().view(bits), reference[name].view(bits)), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_merge_is_the_fp32_sum_rounded_once(dtype):
    generator = torch.Generator().manual_seed(1)
    weight = (torch.randn(48, 40, generator=generator) * 0.05).to(dtype)
    b = torch.randn(48, 8, generator=generator).to(dtype)
    a = torch.randn(8, 40, generator=generator).to(dtype)
    scaling = 0.25
    exact = weight.double() + scaling * (b.double() @ a.double())
    naive = weight + scaling * (b @ a)  # what a 16-bit merge (PEFT's on the device) computes
    merged = weight.clone()
    merge_into(merged, b, a, scaling)
    assert_within_naive_error(merged, naive, exact, what=f"merge {dtype}")
    # one rounding of the fp32 sum: the same bits as the fp32 reference path rounded at the end
    assert torch.equal(merged, (weight.float() + scaling * (b.float() @ a.float())).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_thousand_merge_restore_cycles_are_bit_exact(dtype):
    model = _lora_model(dtype)
    original = _base_weights(model)
    sampling = MergedSampling(model, "default", pin=False)
    changed = subtraction_drift = 0
    for cycle in range(1000):
        with sampling.sampling():
            if cycle == 0:
                for target in sampling.targets:
                    merged, base = target.weight.detach().clone(), _orig(original, target)
                    changed += int((merged != base).sum())
                    b, a, scaling = target.factors()
                    # what restoring by subtraction in the weight's own precision would give back
                    subtracted = (merged.float() - scaling * (b.float() @ a.float())).to(dtype)
                    subtraction_drift += int((subtracted != base).sum())
        if cycle % 97 == 0:
            randomize_adapter(model, seed=cycle)  # the adapter trains between generations
    assert changed > 0, "the merge changed no weight: the test would prove nothing"
    assert subtraction_drift > 0, "no element where subtraction drifts: the inputs do not exercise the exact restore"
    _assert_bitwise_equal(model, original)
    sampling.close()


def _orig(original: dict[str, torch.Tensor], target) -> torch.Tensor:
    return original[f"{target.name}.base_layer.weight"]


def test_weights_are_merged_inside_the_block_only():
    model = _lora_model(torch.bfloat16)
    original = _base_weights(model)
    sampling = MergedSampling(model, "default", pin=False)
    target = sampling.targets[0]
    b, a, scaling = target.factors()
    expected = (_orig(original, target).float() + scaling * (b.float() @ a.float())).to(torch.bfloat16)
    with sampling.sampling():
        assert sampling.merged
        assert torch.equal(target.weight, expected)
    assert not sampling.merged
    _assert_bitwise_equal(model, original)
    sampling.close()


@pytest.mark.parametrize("interruption", [RuntimeError("reward server down"), KeyboardInterrupt()])
def test_every_way_out_of_generation_restores(interruption):
    model = _lora_model(torch.bfloat16)
    original = _base_weights(model)
    sampling = MergedSampling(model, "default", pin=False)
    with pytest.raises(type(interruption)):
        with sampling.sampling():
            raise interruption
    _assert_bitwise_equal(model, original)
    sampling.close()


def test_a_merge_stopped_half_way_is_restored(monkeypatch):
    import trl_turbo.vllm.merge as merge

    model = _lora_model(torch.bfloat16)
    original = _base_weights(model)
    sampling = MergedSampling(model, "default", pin=False)
    calls = []

    def merge_until_interrupted(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        merge_into(*args)

    monkeypatch.setattr(merge, "merge_into", merge_until_interrupted)
    with pytest.raises(KeyboardInterrupt):
        with sampling.sampling():
            pass
    assert len(calls) == 3 and not sampling.merged
    _assert_bitwise_equal(model, original)
    sampling.close()


def test_the_model_never_computes_or_saves_from_merged_weights():
    model = _lora_model(torch.bfloat16)
    original = _base_weights(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    sampling = MergedSampling(model, "default", pin=False)
    sampling.merge()  # left merged, as if a restore never ran
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # the forward pre-hook restores first
    assert torch.equal(logits, expected)
    _assert_bitwise_equal(model, original)
    sampling.merge()
    state = model.state_dict()  # a save reads the state dict: restored first
    for name, value in original.items():
        assert torch.equal(state[name], value), name
    sampling.close()


def test_merge_through_views_of_a_packed_tensor_lands_on_its_rows():
    """Shared weights are views of vLLM's fused q/k/v and gate/up tensors: merging through the views writes the right
    rows and the restore gives the packed tensor back bit for bit."""
    model = _lora_model(torch.bfloat16)
    attention = model.base_model.model.model.layers[0].self_attn
    shards = [attention.q_proj, attention.k_proj, attention.v_proj]
    packed = torch.cat([s.base_layer.weight.detach() for s in shards])
    start = 0
    for shard in shards:
        rows = shard.base_layer.weight.shape[0]
        shard.base_layer.weight.data = packed[start : start + rows]
        start += rows
    before = packed.clone()
    sampling = MergedSampling(model, "default", pin=False)
    with sampling.sampling():
        start = 0
        for shard in shards:
            rows = shard.base_layer.weight.shape[0]
            b = shard.lora_B["default"].weight.float()
            a = shard.lora_A["default"].weight.float()
            expected = (before[start : start + rows].float() + shard.scaling["default"] * (b @ a)).to(torch.bfloat16)
            assert torch.equal(packed[start : start + rows], expected)
            start += rows
    assert torch.equal(packed.view(torch.int16), before.view(torch.int16))
    sampling.close()


def test_tied_and_embedding_adapters_are_not_merged():
    model = tiny_model("llama", vocab_size=64, hidden_size=32, layers=1, dtype=torch.bfloat16, tie_word_embeddings=True)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    problems = merge_problems(peft_model, "default")
    assert any("lm_head" in p and "tied" in p for p in problems), problems
    with pytest.raises(ValueError, match="tied"):
        MergedSampling(peft_model, "default", pin=False)
    model = tiny_model("llama", vocab_size=64, hidden_size=32, layers=1, dtype=torch.bfloat16)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"]))
    assert any("embed_tokens" in p for p in merge_problems(peft_model, "default"))
    untied = get_peft_model(tiny_model("llama", vocab_size=64, hidden_size=32, layers=1, dtype=torch.bfloat16),
                            LoraConfig(r=4, target_modules="all-linear"))
    assert merge_problems(untied, "default") == []
    assert len(lora_targets(untied, "default")) == 7


def test_layers_other_than_linear_are_not_merged():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=64))
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    assert any("Conv1D" in p for p in merge_problems(peft_model, "default"))


def test_host_copy_budget():
    gib = 2**30
    assert host_copy_problem(15 * gib, 1, 128 * gib) is None
    problem = host_copy_problem(15 * gib, 8, 128 * gib)
    assert problem is not None and "120.0 GiB" in problem and "8 processes" in problem


# ------------------------------------------------------------------------------------------ the engine's choice
def _generation(model):
    import types

    return types.SimpleNamespace(mode="colocate", model=model, accelerator=types.SimpleNamespace(
        mixed_precision="bf16", device=torch.device("cpu")), max_num_seqs=8, max_model_length=512,
        max_completion_length=64)


def _config(sampling):
    import types

    return types.SimpleNamespace(turbo_vllm_shared_weights=True, turbo_vllm_standby=False,
                                 turbo_vllm_kv_cache_dtype="auto", turbo_vllm_sampling=sampling)


def _engine_sampling(generation, config, sharing):
    """The sampling mode an engine holding the weights as `sharing` says plans, with the run's warnings."""
    from trl_turbo.config import Settings
    from trl_turbo.vllm import engine_plan

    if sharing is None:  # TRL's own engine
        return None
    settings = Settings.of(config)
    mode, problems = engine_plan.sampling_from(settings.vllm_sampling, sharing,
                                               engine_plan.engine_facts(generation.model))
    plan = engine_plan.EnginePlan(sharing=sharing, sampling=mode, sampling_problems=tuple(problems),
                                  parks_while_starting=False, fp8_parks_base=False, fp8_park_problem=None,
                                  standby=False, kv_cache_dtype=settings.vllm_kv_cache_dtype)
    engine_plan.warn_engine_plan(plan, settings)
    return mode


def test_engine_samples_merged_where_it_can_and_through_lora_slots_otherwise(monkeypatch):
    import types
    import warnings

    from trl_turbo.config import Settings
    from trl_turbo.vllm import engine_plan
    from trl_turbo.vllm.sharing import Sharing

    model = _lora_model(torch.bfloat16)
    generation = _generation(model)
    shared, copy = Sharing(), Sharing(reasons=("8-bit",))
    monkeypatch.setattr(engine_plan, "available_host_bytes", lambda: 64 * 2**30)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default choice warns about nothing
        assert _engine_sampling(generation, _config("auto"), shared) == "merged"
        assert _engine_sampling(generation, _config("merged"), shared) == "merged"
        assert _engine_sampling(generation, _config("lora"), shared) == "lora"
        assert _engine_sampling(generation, _config("auto"), copy) == "lora"
        settings = Settings.of(types.SimpleNamespace(turbo_vllm_shared_weights=False))
        assert engine_plan.plan_engine(settings, None).sampling is None  # TRL's own engine
    merged_kwargs = engine_plan.engine_kwargs(generation, _config("auto"), shared, "merged")
    assert "enable_lora" not in merged_kwargs and merged_kwargs["load_format"] == "dummy"  # no LoRA slots
    assert engine_plan.engine_kwargs(generation, _config("lora"), shared, "lora")["enable_lora"]
    with pytest.warns(RuntimeWarning, match="separate copy.*LoRA layers"):
        assert _engine_sampling(generation, _config("merged"), copy) == "lora"
    monkeypatch.setattr(engine_plan, "available_host_bytes", lambda: 2**10)  # a host copy would not fit
    assert _engine_sampling(generation, _config("auto"), shared) == "lora"
    with pytest.warns(RuntimeWarning, match="host copy"):
        assert _engine_sampling(generation, _config("merged"), shared) == "lora"


class _StandInLLM:
    def __init__(self):
        self.prefix_cache_resets = 0

    def reset_prefix_cache(self):
        self.prefix_cache_resets += 1


@pytest.mark.parametrize("failure", [None, RuntimeError("vLLM failed"), KeyboardInterrupt()])
def test_generation_samples_merged_weights_and_leaves_the_base_restored(monkeypatch, failure):
    import types

    from trl_turbo.patches import trl_vllm
    from trl_turbo.vllm import engine_plan

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1, 2))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    model = _lora_model(torch.bfloat16)
    original = _base_weights(model)
    state = engine_plan.EngineState()
    state.merged = MergedSampling(model, "default", pin=False)
    llm = _StandInLLM()
    generation = types.SimpleNamespace(_trl_turbo_engine=state, llm=llm,
                                       accelerator=types.SimpleNamespace(device=torch.device("cpu")))
    seen = []

    def trl_generate(self, prompts):
        target = state.merged.targets[0]
        seen.append(not torch.equal(target.weight, _orig(original, target)))  # vLLM reads merged weights
        if failure is not None:
            raise failure
        return prompts

    generate = trl_vllm._wrap_generate(trl_generate)
    if failure is None:
        assert generate(generation, [[1, 2]]) == [[1, 2]]
    else:
        with pytest.raises(type(failure)):
            generate(generation, [[1, 2]])
    assert seen == [True] and llm.prefix_cache_resets == 1  # blocks cached with other weights are dropped
    _assert_bitwise_equal(model, original)
    assert not state.merged.merged
    metrics = engine_plan.drain_metrics(generation)
    assert metrics["vllm/merge_s"] >= 0 and metrics["vllm/restore_gib"] > 0 and metrics["vllm/merged_host_copy_gib"] > 0
    sync = trl_vllm._wrap_sync_weights(lambda self: pytest.fail("TRL's full-weight push must not run"))
    assert sync(generation) is None
    state.merged.close()


def test_sampling_field_is_validated_at_config_time(tmp_path):
    from trl import GRPOConfig

    import trl_turbo  # noqa: F401  (the fields exist after import)

    with pytest.raises(ValueError, match="turbo_vllm_sampling='fp16'"):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, turbo_vllm_sampling="fp16")
    with pytest.raises(ValueError, match="turbo_vllm_shared_weights=True"):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, turbo_vllm_sampling="merged")
    assert GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False).turbo_vllm_sampling == "auto"


def test_shared_4bit_weights_sample_through_lora_slots(tmp_path, monkeypatch):
    pytest.importorskip("bitsandbytes")
    from helpers import quantized_peft_model

    from trl_turbo.vllm.sharing import sharing_mode

    model = quantized_peft_model(tmp_path, load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                  bnb_4bit_compute_dtype=torch.bfloat16)
    sharing = sharing_mode(model)
    assert sharing.mode == "shared"
    assert _engine_sampling(_generation(model), _config("auto"), sharing) == "lora"
    with pytest.warns(RuntimeWarning, match="4-bit"):
        assert _engine_sampling(_generation(model), _config("merged"), sharing) == "lora"
