"""GPU + vLLM: the shared-weight engine inside a real GRPOTrainer run (one engine per process, so one module-scoped
run): one copy of the base weights, samples from the live adapter, KV standby with flat memory over 50 steps, and
learning on a verifiable toy task with vLLM sampling."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from trl_turbo.tasks import arithmetic
from trl_turbo.tasks.arithmetic import make_length_reward
from trl_turbo.testing import parity
from trl_turbo.testing.models import tiny_model
from trl_turbo.testing.tokenizer import EOS_ID, VOCAB, build_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")]
CAP = 16
STEPS = 50


@torch.no_grad()
def _stop_early(model: torch.nn.Module) -> None:
    """Tilt the EOS row of the LM head so the random model ends after a few tokens (the length reward can rise)."""
    weight = model.lm_head.weight
    ids = torch.randint(3, weight.shape[0], (8, 24), generator=torch.Generator().manual_seed(0))
    hidden = model(ids, output_hidden_states=True).hidden_states[-1].reshape(-1, weight.shape[1]).float()
    direction = hidden.mean(0)
    weight[EOS_ID] += (3.0 * direction / direction.pow(2).sum()).to(weight.dtype)


def _storage_spans(llm) -> list[tuple[int, int]]:
    from trl_turbo.patches.vllm_engine import driver_model

    return [(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size())
            for _, p in driver_model(llm).named_parameters()]


@torch.no_grad()
def _logprob_gaps(trainer) -> tuple[float, float]:
    """Sample with vLLM (live adapter); mean |Δ log-prob| of the sampled tokens against HF with the adapter and
    against HF without it."""
    from vllm import SamplingParams

    generation = trainer.vllm_generation
    state = generation._trl_turbo_engine
    generation.sync_weights()
    state.standby.restore()
    prompts = [[3 + (7 * i + j) % (len(VOCAB) - 3) for j in range(10)] for i in range(8)]
    outputs = generation.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                      SamplingParams(temperature=1.0, max_tokens=8, logprobs=0, ignore_eos=True,
                                                     seed=0),
                                      lora_request=state.lora_request, use_tqdm=False)
    state.standby.release()
    model = trainer.model
    model.eval()
    gaps = {"adapter": [], "base": []}
    for prompt, output in zip(prompts, outputs):
        completion = list(output.outputs[0].token_ids)
        sampled = torch.tensor([lp[t].logprob for lp, t in zip(output.outputs[0].logprobs, completion)])
        ids = torch.tensor([prompt + completion], device=model.device)
        for name in gaps:
            if name == "base":
                with model.disable_adapter():
                    logits = model(ids).logits
            else:
                logits = model(ids).logits
            logps = logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
            hf = logps.gather(-1, ids[0, len(prompt) :, None]).squeeze(-1).cpu()
            gaps[name].append((hf - sampled).abs().mean())
    model.train()
    return float(torch.stack(gaps["adapter"]).mean()), float(torch.stack(gaps["base"]).mean())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    path = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_model("llama", vocab_size=len(VOCAB), hidden_size=256, layers=2, dtype=torch.bfloat16, head_dim=64,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                       tie_word_embeddings=False)
    _stop_early(model)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    config = GRPOConfig(**parity.base_config_kwargs(
        str(path / "out"), use_cpu=False, bf16=True, use_vllm=True, vllm_mode="colocate",
        turbo_vllm_shared_weights=True, turbo_vllm_standby=True, max_steps=STEPS, per_device_train_batch_size=8,
        num_generations=8, max_completion_length=CAP, learning_rate=2e-3, optim="adamw_torch",
        model_init_kwargs={"dtype": "bfloat16"},
    ))
    trainer = GRPOTrainer(
        model=str(path), reward_funcs=[make_length_reward(CAP)], args=config,
        train_dataset=arithmetic.load_dataset("train").select(range(64)), processing_class=build_tokenizer(),
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0),
    )
    result = {"trainer": trainer, "spans": _storage_spans(trainer.vllm_generation.llm)}
    for name, param in trainer.model.named_parameters():  # an adapter that visibly moves the samples
        if "lora_B" in name:
            param.data.normal_(0, 0.02)
    result["gaps_before"] = _logprob_gaps(trainer)
    used = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            free, total = torch.cuda.mem_get_info()
            used.append(total - free)

    trainer.add_callback(Record())
    trainer.train()
    result["used"] = used
    result["gaps_after"] = _logprob_gaps(trainer)
    print({k: v for k, v in result.items() if k.startswith("gaps")})
    return result


def test_base_weights_exist_once(run):
    from trl_turbo.patches.vllm_engine import _frozen_matrix_weights

    frozen = _frozen_matrix_weights(run["trainer"].model.get_base_model())
    assert len(frozen) == 2 * 7 + 2
    for name, weight in frozen.items():
        assert any(start <= weight.data_ptr() < stop for start, stop in run["spans"]), f"{name} is a second copy"


def test_vllm_samples_from_the_live_adapter(run):
    for adapter_gap, base_gap in (run["gaps_before"], run["gaps_after"]):
        assert adapter_gap < 0.05 and base_gap > 4 * adapter_gap, (adapter_gap, base_gap)


def test_standby_releases_kv_each_step_and_memory_stays_flat(run):
    logs = [log for log in run["trainer"].state.log_history if "vllm/kv_released_gib" in log]
    assert len(logs) == STEPS
    assert all(log["vllm/kv_released_gib"] > 0 and log["vllm/kv_restored_gib"] > 0 for log in logs[1:])
    assert max(log["vllm/weight_sync_s"] for log in logs) < 0.5
    used = run["used"][5:]
    assert max(used) - min(used) <= 256 << 20, [u >> 20 for u in run["used"]]


def test_reward_rises_with_vllm_sampling(run):
    lengths = [log["completions/mean_length"] for log in run["trainer"].state.log_history
               if "completions/mean_length" in log]
    first, last = sum(lengths[:5]) / 5, sum(lengths[-5:]) / 5
    assert last >= first + 3, lengths
