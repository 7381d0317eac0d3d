"""Checks of the shared-weight vLLM engine inside a real GRPOTrainer (GPU + vLLM), shared by the GPU tests; for a
model vLLM cannot share with (8-bit, non-uint8 4-bit storage, another family), the checks of its separate copy.

Design decision: one vLLM engine lives per process, so each model family is checked by running this module as a
child process (``python -m trl_turbo.testing.vllm_checks <arch> <dir>``, or under ``accelerate launch``, one
engine per rank), which prints one ``RESULT {json}`` line per rank; the test asserts on it. The checks compare
log-probabilities, not greedy tokens, because a random-init model's logits are near ties and greedy tokens flip between
kernels.
"""

from __future__ import annotations

import contextlib
import json
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from trl_turbo.planning.shapes import QUANTIZATIONS as BENCH_QUANTIZATIONS
from trl_turbo.testing.tokenizer import EOS_ID, VOCAB, build_tokenizer
from trl_turbo.vllm.engine_plan import engine_state
from trl_turbo.vllm.quantized import is_packed_4bit


@torch.no_grad()
def stop_early(model: torch.nn.Module) -> None:
    """Tilt the EOS row of the LM head so the random model ends after a few tokens (a length reward can rise)."""
    weight = model.get_output_embeddings().weight
    ids = torch.randint(3, weight.shape[0], (8, 24), generator=torch.Generator().manual_seed(0))
    hidden = model(ids, output_hidden_states=True).hidden_states[-1].reshape(-1, weight.shape[1]).float()
    direction = hidden.mean(0)
    weight[EOS_ID] += (3.0 * direction / direction.pow(2).sum()).to(weight.dtype)


def vllm_storage_spans(llm: Any) -> list[tuple[int, int]]:
    from trl_turbo.vllm.engine import driver_model

    return [(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size())
            for _, p in driver_model(llm).named_parameters()]


def _frozen(trainer: Any) -> dict[str, torch.Tensor]:
    from trl_turbo.vllm.engine import frozen_matrix_weights

    return frozen_matrix_weights(trainer.model.get_base_model())


def copy_mismatches(llm: Any, model: torch.nn.Module) -> list[str]:
    """The frozen HF matrices whose dequantized values are not their rows of vLLM's weights (a separate copy), or
    that vLLM lacks."""
    from trl_turbo.vllm.dequantized import dequantized_state
    from trl_turbo.vllm.engine import engine_dtype, frozen_matrix_weights, hf_state_for_vllm, peft_base, plan_views
    from trl_turbo.vllm.weight_views import view_of

    base = peft_base(model)
    frozen = frozen_matrix_weights(base)
    expected = {name: tensor for name, tensor in dequantized_state(base, hf_state_for_vllm(base), engine_dtype(llm))
                if name in frozen}
    _, params, views = plan_views(llm, base, weights=expected)
    differing = []
    for view in views:
        rows = view_of(params[view.vllm_name], view)
        if not torch.equal(rows, expected[view.hf_name].to(rows.device)):
            differing.append(view.hf_name)
    return sorted(frozen.keys() - expected.keys()) + differing


def weight_copies(trainer: Any) -> dict[str, Any]:
    """How many frozen HF matrices there are, and which of them do not live inside vLLM's weights (a second copy)."""
    spans = vllm_storage_spans(trainer.vllm_generation.llm)
    frozen = _frozen(trainer)
    second = [name for name, weight in frozen.items()
              if not any(start <= weight.data_ptr() < stop for start, stop in spans)]
    return {"frozen_matrices": len(frozen), "second_copies": second}


def engine_generate(trainer: Any, token_ids: list[list[int]], params: Any) -> list[Any]:
    """vLLM's outputs for the prompts `token_ids` under SamplingParams `params`, from the live adapter in whichever
    sampling mode the engine has, with the KV cache mapped for this call only."""
    import contextlib

    generation = trainer.vllm_generation
    state = engine_state(generation)
    generation.sync_weights()
    # merged sampling: the adapter is in vLLM's weights for this block only
    with state.merged.sampling() if state.merged is not None else contextlib.nullcontext():
        state.standby.restore()  # also resets the prefix cache: blocks of other weights are not reused
        if state.fp8 is not None:  # fp8 sampling: the copy is written from the live adapter after the restore
            state.fp8.write()
        outputs = generation.llm.generate([{"prompt_token_ids": p} for p in token_ids], params,
                                          lora_request=None if state.merged is not None else state.lora_request,
                                          use_tqdm=False)
        state.standby.release()
    return outputs


@torch.no_grad()
def logprob_gaps(trainer: Any, prompts: int = 8, tokens: int = 8) -> tuple[float, float]:
    """Sample with vLLM (live adapter); mean |Δ log-prob| of the sampled tokens against HF with the adapter and
    against HF without it."""
    from vllm import SamplingParams

    token_ids = [[3 + (7 * i + j) % (len(VOCAB) - 3) for j in range(10)] for i in range(prompts)]
    outputs = engine_generate(trainer, token_ids, SamplingParams(temperature=1.0, max_tokens=tokens, logprobs=0,
                                                                 ignore_eos=True, seed=0))
    model = trainer.model
    model.eval()
    gaps: dict[str, list[torch.Tensor]] = {"adapter": [], "base": []}
    for prompt, output in zip(token_ids, outputs):
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


def randomize_adapter(model: torch.nn.Module, std: float = 0.02) -> None:
    """Give LoRA's B matrices (zero at init) values, so the adapter visibly moves the samples."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, std, generator=torch.Generator(param.device).manual_seed(0))


# bitsandbytes configs the checks run with (`python -m trl_turbo.testing.vllm_checks <arch> <dir> nf4`); vLLM holds a
# separate copy of the last two
QUANTIZATIONS: dict[str, dict[str, Any]] = {
    "nf4": BENCH_QUANTIZATIONS["nf4"],
    "fp4": {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4", "bnb_4bit_compute_dtype": "bfloat16"},
    "int8": {"load_in_8bit": True},
    "nf4-bf16storage": {**BENCH_QUANTIZATIONS["nf4"], "bnb_4bit_quant_storage": "bfloat16"},
}


TINY_SHAPE: dict[str, Any] = {"hidden_size": 256, "layers": 2, "head_dim": 64, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "intermediate_size": 512}


def build_trainer(arch: str, path: Path, steps: int, completion_cap: int, quantization: str | None = None,
                  model_shape: dict[str, Any] | None = None, lora: bool = True, **config_overrides: Any) -> Any:
    """A shared-weight, standby GRPOTrainer with colocated vLLM over a tiny random ``arch`` model (``TINY_SHAPE``, or
    ``model_shape``) saved at ``path`` (loaded through bitsandbytes with one of ``QUANTIZATIONS``, if named), training
    a LoRA adapter (every weight with ``lora=False``)."""
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from trl_turbo.tasks import arithmetic
    from trl_turbo.tasks.arithmetic import make_length_reward
    from trl_turbo.testing import parity
    from trl_turbo.testing.models import tiny_model

    model = tiny_model(arch, vocab_size=len(VOCAB), dtype=torch.bfloat16, **(model_shape or TINY_SHAPE))
    stop_early(model)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    config = GRPOConfig(**parity.base_config_kwargs(
        str(path / "out"), use_cpu=False, bf16=True, use_vllm=True, vllm_mode="colocate",
        turbo_vllm_shared_weights=True, turbo_vllm_standby=True, max_steps=steps, per_device_train_batch_size=8,
        num_generations=8, max_completion_length=completion_cap, learning_rate=2e-3, optim="adamw_torch",
        model_init_kwargs={"dtype": "bfloat16", **({"quantization_config": QUANTIZATIONS[quantization]}
                                                   if quantization else {})}, **config_overrides,
    ))
    return GRPOTrainer(
        model=str(path), reward_funcs=[make_length_reward(completion_cap)], args=config,
        train_dataset=arithmetic.load_dataset("train").select(range(64)), processing_class=build_tokenizer(),
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0) if lora else None,
    )


def sampling_mode(trainer: Any) -> str:
    """The sampling mode the trainer's engine chose, and that vLLM's model has LoRA layers exactly when it is "lora"."""
    from trl_turbo.vllm.engine import driver_model

    state = engine_state(trainer.vllm_generation)
    mode = "merged" if state.merged is not None else "fp8" if state.fp8 is not None else "lora"
    engine_model = driver_model(trainer.vllm_generation.llm)
    lora_layers = any(".base_layer." in name for name, _ in engine_model.named_parameters())
    if lora_layers != (mode == "lora"):
        raise AssertionError(f"{mode} sampling, but vLLM's model {'has' if lora_layers else 'has no'} LoRA layers")
    return mode


def frozen_snapshot(trainer: Any) -> dict[str, torch.Tensor]:
    """The frozen base matrices, copied to the host (bit patterns)."""
    return {name: weight.detach().cpu().clone() for name, weight in _frozen(trainer).items()}


def changed_matrices(trainer: Any, snapshot: dict[str, torch.Tensor]) -> list[str]:
    """The frozen matrices whose bits differ from `snapshot`."""
    torch.cuda.synchronize()
    now = _frozen(trainer)
    return sorted(name for name, weight in snapshot.items()
                  if not torch.equal(now[name].detach().cpu().view(torch.uint8), weight.view(torch.uint8)))


@contextlib.contextmanager
def eager_engines(seed_offset: int = 0) -> Iterator[None]:
    """Within the block, the engines TRL builds run eagerly (no compilation or CUDA graphs), with their sampling seed
    shifted by `seed_offset`; TRL's `LLM` comes back afterwards (through the registry)."""
    import trl.generation.vllm_generation as vllm_generation

    from trl_turbo import registry

    original = vllm_generation.LLM

    def eager_llm(*args: Any, **kwargs: Any) -> Any:
        kwargs["enforce_eager"] = True
        if seed_offset:
            kwargs["seed"] = kwargs.get("seed", 0) + seed_offset
        return original(*args, **kwargs)

    with registry.scoped(vllm_generation, "LLM", eager_llm):
        yield


def check_family(arch: str, path: Path, steps: int = 3, quantization: str | None = None,
                 sampling: str = "auto") -> dict[str, Any]:
    """One copy of the base weights (or, where vLLM cannot share them, a separate copy holding the training
    model's dequantized values), samples from the live adapter before and after training steps."""
    # Eager vLLM: compiling and capturing graphs would take most of each family's time and is not what is checked
    with warnings.catch_warnings(record=True) as caught, eager_engines():
        warnings.simplefilter("always")
        trainer = build_trainer(arch, path, steps=steps, completion_cap=8, quantization=quantization,
                                turbo_vllm_sampling=sampling)
    # DeepSpeed places the model on the device only when training starts; the checks before it need it there now
    trainer.model.to(trainer.accelerator.device)
    randomize_adapter(trainer.model)
    llm = trainer.vllm_generation.llm
    separate = engine_state(trainer.vllm_generation).copy_bytes > 0
    result: dict[str, Any] = {"arch": arch, "quantization": quantization, "separate_copy": separate,
                              "fallback_warnings": sum("separate 16-bit copy" in str(w.message) for w in caught),
                              "copies_before": weight_copies(trainer)}
    result["copy_mismatches_before"] = copy_mismatches(llm, trainer.model) if separate else None
    result["sampling"] = sampling_mode(trainer)
    observed = observed_training(trainer)
    result.update({key: observed[key] for key in ("gaps_before", "rollout_alarms", "gaps_after")})
    result["changed_base_matrices"] = observed["changed_after_training"]
    result["copies_after"] = weight_copies(trainer)
    result["copy_mismatches_after"] = copy_mismatches(llm, trainer.model) if separate else None
    result["four_bit_matrices"] = sum(is_packed_4bit(w) for w in _frozen(trainer).values())
    logs = trainer.state.log_history
    result["weight_sync_s"] = [log["vllm/weight_sync_s"] for log in logs if "vllm/weight_sync_s" in log]
    result["separate_copy_gib"] = [log["vllm/separate_copy_gib"] for log in logs if "vllm/separate_copy_gib" in log]
    return result


def observed_training(trainer: Any) -> dict[str, Any]:
    """Train with the engine: the sampler's log-prob gaps (live adapter, base) before and after, the rollout alarms
    raised, the frozen matrices changed, and the snapshot they were compared with."""
    before = frozen_snapshot(trainer)
    result: dict[str, Any] = {"gaps_before": logprob_gaps(trainer)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    result["rollout_alarms"] = rollout_alarms(caught)
    result["gaps_after"] = logprob_gaps(trainer)
    result["changed_after_training"] = changed_matrices(trainer, before)
    result["snapshot"] = before
    return result


def train_recording(trainer: Any) -> dict[str, Any]:
    """Randomize the adapter, then `observed_training`, with the device memory in use after each step ("used")."""
    from transformers import TrainerCallback

    randomize_adapter(trainer.model)
    used: list[int] = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            free, total = torch.cuda.mem_get_info()
            used.append(total - free)

    trainer.add_callback(Record())
    return {**observed_training(trainer), "used": used}


@torch.no_grad()
def greedy_comparison(trainer: Any, path: Path, prompts: int = 8, tokens: int = 16) -> dict[str, Any]:
    """Greedy vLLM samples in the engine's merged mode against greedy decoding of HF with the adapter merged (a fresh
    copy of the base from ``path``, merged in fp32 and rounded once to bf16, as the merged mode writes it) and of HF
    without the adapter (the control). Per prompt and reference: the index of the first token where HF's greedy
    choice differs from vLLM's (None: all the same) and, there, HF's margin between its top two logits (kernels'
    rounding flips only near ties)."""
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    if engine_state(trainer.vllm_generation).merged is None:
        raise AssertionError("greedy_comparison checks the merged mode")
    token_ids = [[3 + (5 * i + 2 * j) % (len(VOCAB) - 3) for j in range(10)] for i in range(prompts)]
    outputs = engine_generate(trainer, token_ids, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    sampled = [list(output.outputs[0].token_ids) for output in outputs]

    device = trainer.model.device
    fresh = get_peft_model(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32),
                           trainer.model.peft_config["default"])
    set_peft_model_state_dict(fresh, {name: tensor.float().cpu()
                                      for name, tensor in get_peft_model_state_dict(trainer.model).items()})
    references = {"merged_hf": fresh.merge_and_unload().to(device=device, dtype=torch.bfloat16),
                  "base_hf": AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).to(device)}
    result: dict[str, Any] = {}
    for name, model in references.items():
        model.eval()
        first_difference: list[int | None] = []
        margins: list[float | None] = []
        for prompt, vllm_tokens in zip(token_ids, sampled):
            ids = torch.tensor([prompt], device=device)
            index, margin = None, None
            for position, vllm_token in enumerate(vllm_tokens):
                top = model(ids).logits[0, -1].float().topk(2)
                if int(top.indices[0]) != vllm_token:
                    index, margin = position, float(top.values[0] - top.values[1])
                    break
                ids = torch.cat([ids, top.indices[:1].view(1, 1)], dim=1)
            first_difference.append(index)
            margins.append(margin)
        result[name] = {"first_difference": first_difference, "margin_at_difference": margins}
    return result


def curve_run(arch: str, path: Path, sampling: str, vllm_seed_offset: int = 0, steps: int = 30) -> dict[str, Any]:
    """Train the toy task with eager vLLM in one sampling mode; the engine's sampling seed is shifted by
    ``vllm_seed_offset`` (the run-to-run noise reference). Returns the per-step loss, reward and the sampler/trainer
    log-prob gap TRL logs."""
    with eager_engines(vllm_seed_offset):
        trainer = build_trainer(arch, path, steps=steps, completion_cap=16, turbo_vllm_sampling=sampling)
    trainer.train()
    logs = trainer.state.log_history

    def series(key: str) -> list[float]:
        return [log[key] for log in logs if key in log]

    return {"arch": arch, "sampling": sampling_mode(trainer), "loss": series("loss"), "reward": series("reward"),
            "logp_gap": series("sampling/sampling_logp_difference/mean")}


RESUME_STEPS, RESUME_AT = 6, 3


def resume_run(arch: str, path: Path, phase: str) -> dict[str, Any]:
    """One phase of the resume check, with shared weights, standby and merged sampling: "whole" trains
    `RESUME_STEPS` steps saving at `RESUME_AT`; "first" stops after saving there; "resumed" builds a new trainer
    (and engine) over the same directory and resumes from that checkpoint. Transformers restores the CUDA RNG state
    the checkpoint saved, which vLLM's unseeded sampling draws from, so the resumed run can sample what the
    uninterrupted one did. Returns the per-step loss, reward and grad norm, and which frozen matrices changed."""
    from transformers import TrainerCallback

    with eager_engines():
        trainer = build_trainer(arch, path, steps=RESUME_STEPS, completion_cap=16, save_strategy="steps",
                                save_steps=RESUME_AT)
    before = frozen_snapshot(trainer)
    if phase == "first":
        class StopAtSave(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if state.global_step == RESUME_AT:
                    control.should_training_stop = True

        trainer.add_callback(StopAtSave())
        trainer.train()
    elif phase == "resumed":
        trainer.train(resume_from_checkpoint=str(Path(trainer.args.output_dir) / f"checkpoint-{RESUME_AT}"))
    else:
        trainer.train()
    curves = {str(log["step"]): {key: log[key] for key in ("loss", "reward", "grad_norm")}
              for log in trainer.state.log_history if "loss" in log and "grad_norm" in log}
    return {"arch": arch, "phase": phase, "sampling": sampling_mode(trainer), "curves": curves,
            "global_step": trainer.state.global_step, "changed_base_matrices": changed_matrices(trainer, before)}


def rollout_alarms(caught: list[Any]) -> int:
    """How many of the recorded warnings are the rollout sanity alarm."""
    return sum("do not come from the policy" in str(w.message) for w in caught)


def stale_adapter_run(arch: str, path: Path, sampling: str, steps: int = 8) -> dict[str, Any]:
    """Train with an engine whose adapter never reaches vLLM (the push skipped in "lora" mode, the merge skipped in
    "merged" mode): vLLM samples from the base weights while the trainer's policy moves. After step 2 the adapter is
    given the size a few hundred steps of training would give it (`randomize_adapter`), so the drift the alarm watches
    for shows within the test's steps. Returns at which step the alarm tripped (None: never) and the logged gaps."""
    trainer = build_trainer(arch, path, steps=steps, completion_cap=8, turbo_vllm_sampling=sampling)
    state = engine_state(trainer.vllm_generation)
    if state.merged is None and state.adapters is None:
        raise AssertionError("the engine has neither merged nor LoRA sampling")
    if state.merged is not None:
        state.merged.merge = lambda: None  # nothing merged, nothing to restore
    else:
        state.adapters.push = lambda tensors, config: None  # no LoRARequest: vLLM's plain base weights
    tripped_at = []

    from transformers import TrainerCallback

    class WatchAlarm(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 2:
                randomize_adapter(trainer.model)
            watch = getattr(trainer, "_trl_turbo_rollout", None)
            if watch is not None and watch.check.tripped and not tripped_at:
                tripped_at.append(state.global_step)

    trainer.add_callback(WatchAlarm())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    gaps = [log["sampling/sampling_logp_difference/mean"] for log in trainer.state.log_history
            if "sampling/sampling_logp_difference/mean" in log]
    return {"arch": arch, "sampling": sampling_mode(trainer), "alarms": rollout_alarms(caught),
            "tripped_at_step": tripped_at[0] if tripped_at else None, "gaps": gaps}


def _unused_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_in_child(arch: str, workdir: Path, quantization: str | None = None, sampling: str = "auto",
                 *extra: str) -> dict[str, Any]:
    """Run this module's checks for ``arch`` in a fresh Python process (one vLLM engine per process) and return its
    ``RESULT`` line; ``extra`` selects another check ("stale", "curve" and a vLLM seed offset, or "resume" and a
    phase)."""
    import subprocess

    from trl_turbo.testing.multi_gpu import fresh_rendezvous_env

    # An engine of the calling process left TRL's MASTER_PORT etc. in os.environ. Without one, TRL's colocate
    # engine takes the first free port of a fixed list (29500 first), so children running side by side (one pytest
    # process per test shard) would race for it: each child gets a port the OS just handed out.
    command = [sys.executable, "-m", "trl_turbo.testing.vllm_checks", arch, str(workdir), quantization or "none",
               sampling, *extra]
    env = {**fresh_rendezvous_env(), "MASTER_PORT": str(_unused_port())}
    process = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    lines = [line for line in process.stdout.splitlines() if line.startswith("RESULT ")]
    if process.returncode != 0 or not lines:
        raise AssertionError(process.stdout[-3000:] + process.stderr[-6000:])
    result = json.loads(lines[-1].removeprefix("RESULT "))
    print(result)
    return result


if __name__ == "__main__":
    import os

    # Under `accelerate launch`, every rank checks its own engine, with its own copy of the model files.
    rank = int(os.environ.get("RANK", 0))
    workdir = Path(sys.argv[2]) / f"rank{rank}" if int(os.environ.get("WORLD_SIZE", 1)) > 1 else Path(sys.argv[2])
    quantization = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "none" else None
    sampling = sys.argv[4] if len(sys.argv) > 4 else "auto"
    if sys.argv[5:] == ["stale"]:
        result = {"rank": rank, **stale_adapter_run(sys.argv[1], workdir, sampling)}
    elif sys.argv[5:6] == ["resume"]:
        result = {"rank": rank, **resume_run(sys.argv[1], workdir, sys.argv[6])}
    elif sys.argv[5:6] == ["curve"]:
        result = {"rank": rank, **curve_run(sys.argv[1], workdir, sampling, vllm_seed_offset=int(sys.argv[6]))}
    else:
        result = {"rank": rank, **check_family(sys.argv[1], workdir, quantization=quantization, sampling=sampling)}
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()

    os._exit(0)  # skip interpreter teardown of the in-process engine
