"""Checks of shared weights under FSDP2 with a tensor-parallel vLLM engine inside a real GRPOTrainer (2 GPUs), run
as ``accelerate launch --config_file <TRL's fsdp2.yaml> -m trl_turbo.testing.sharded_checks <dir> [sampling]``;
each rank prints one ``RESULT {json}`` line for the test to assert on.

Per rank, after training: how many of FSDP2's frozen shards live in vLLM's memory, whether each (and each
projection an fp8 engine holds quantized) equals the checkpoint's slice that vLLM's layout gives this rank (bitwise,
so the base never moved), the sampler's log-prob gap
to the live (sharded) policy with and without its adapter, whether vLLM's greedy tokens are the policy's own best
tokens, and the adapter sync times. With ``fault`` as a third argument the run trains 20 steps and one generation in
the middle of them fails inside vLLM; the shards are compared with the checkpoint right after it and at the end.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

FULL_SHAPE = {"hidden_size": 2048, "layers": 2, "head_dim": 128, "num_attention_heads": 16, "num_key_value_heads": 8,
              "intermediate_size": 8192}


def shard_report(trainer: Any, checkpoint: Path) -> dict[str, Any]:
    """Which FSDP2 shards are vLLM's memory, and whether every shared one (and with fp8 sampling, every projection
    vLLM holds in fp8, written from FSDP2's shard) still equals its checkpoint slice."""
    from safetensors.torch import load_file

    from trl_turbo.sharding.adopt import base_parameters, fsdp_params
    from trl_turbo.vllm.engine import driver_model
    from trl_turbo.vllm.sharded import pending_share

    share = pending_share(trainer.model)
    spans = [(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size())
             for p in driver_model(trainer.vllm_generation.llm).parameters()]
    saved = load_file(str(checkpoint / "model.safetensors"))
    planned = {p.hf_name: p for p in share.placement.plan.params}
    by_param = fsdp_params(trainer.model)
    inside, differing, shared_names = 0, [], set(share.result.shared)
    checked = shared_names | set(share.result.kept)
    from vllm.distributed import get_tensor_model_parallel_rank

    tp_rank = get_tensor_model_parallel_rank()
    for hf_name, param in base_parameters(trainer.model):
        data = by_param[id(param)]._sharded_param_data
        inside += any(start <= data.data_ptr() < stop for start, stop in spans)
        if hf_name in checked:
            slice_ = planned[hf_name].layouts[tp_rank].slice
            expected = saved[hf_name].narrow(slice_.dim, slice_.start, slice_.length)
            if not torch.equal(param.to_local().cpu().view(torch.uint8), expected.view(torch.uint8)):
                differing.append(hf_name)
    return {"shards_in_vllm": inside, "shared": len(shared_names), "kept": len(share.result.kept),
            "own_copies": sorted(share.result.own_copies),
            "shared_gib": share.result.shared_bytes / 2**30, "differing_from_checkpoint": differing}


def starting_model(checkpoint: Path, device: torch.device) -> torch.nn.Module:
    """The checkpoint the run started from, whole on `device`: the policy full fine-tuning must have left. Its
    tensors are read from the files, not through `from_pretrained`, which under an FSDP launch with RAM-efficient
    loading gives every rank but the first empty weights (to be broadcast when FSDP wraps the model)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(checkpoint)), dtype=torch.bfloat16)
    state: dict[str, torch.Tensor] = {}
    for path in sorted(Path(checkpoint).glob("*.safetensors")):
        state.update(load_file(str(path), device=str(device)))
    model.load_state_dict(state, strict=True)
    return model.eval()


@torch.no_grad()
def trained_gaps(trainer: Any, checkpoint: Path, prompts: int = 8, tokens: int = 8) -> tuple[float, float]:
    """Full fine-tuning: vLLM samples; mean |Δ log-prob| of the sampled tokens against the trained (sharded) policy
    and against the checkpoint it started from (the sampler must follow the first, not the second)."""
    from vllm import SamplingParams

    from trl_turbo.testing.tokenizer import VOCAB
    from trl_turbo.testing.vllm_checks import engine_generate

    token_ids = [[3 + (7 * i + j) % (len(VOCAB) - 3) for j in range(10)] for i in range(prompts)]
    outputs = engine_generate(trainer, token_ids, SamplingParams(temperature=1.0, max_tokens=tokens, logprobs=0,
                                                                 ignore_eos=True, seed=0))
    device = trainer.accelerator.device
    start = starting_model(checkpoint, device)
    trainer.model.eval()
    gaps: dict[str, list[torch.Tensor]] = {"trained": [], "start": []}
    for prompt, output in zip(token_ids, outputs):
        completion = list(output.outputs[0].token_ids)
        sampled = torch.tensor([lp[t].logprob for lp, t in zip(output.outputs[0].logprobs, completion)])
        ids = torch.tensor([prompt + completion], device=device)
        for name, model in (("trained", trainer.model), ("start", start)):
            logps = model(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
            hf = logps.gather(-1, ids[0, len(prompt):, None]).squeeze(-1).cpu()
            gaps[name].append((hf - sampled).abs().mean())
    trainer.model.train()
    return float(torch.stack(gaps["trained"]).mean()), float(torch.stack(gaps["start"]).mean())


@torch.no_grad()
def greedy_agreement(trainer: Any, checkpoint: Path, full: bool, prompts: int = 8, tokens: int = 12,
                     margin: float = 0.1) -> dict[str, int]:
    """vLLM's greedy continuations read by the trainer's policy (sharded, with its adapter): at every position where
    the policy's best token leads its runner-up by more than `margin` nats, vLLM must have picked that token. Each
    position is conditioned on vLLM's own prefix, so this is what HF's greedy `generate` of the gathered model would
    produce, minus the positions whose near-ties bf16 rounding may break either way. The same tokens read by the
    policy the sampler must not be using (the base without its adapter; for full fine-tuning, the checkpoint it
    started from) must disagree somewhere (`other_mismatched`), or the check could not tell them apart. EOS, whose
    logit the test model tilts up, is left out of both choices."""
    from vllm import SamplingParams

    from trl_turbo.testing.tokenizer import EOS_ID, VOCAB
    from trl_turbo.testing.vllm_checks import engine_generate

    allowed = [token for token in range(len(VOCAB)) if token != EOS_ID]
    token_ids = [[3 + (11 * i + 5 * j) % (len(VOCAB) - 3) for j in range(10)] for i in range(prompts)]
    outputs = engine_generate(trainer, token_ids, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                                                                 allowed_token_ids=allowed))
    device = trainer.accelerator.device
    start = starting_model(checkpoint, device) if full else None
    counts = {"compared": 0, "mismatched": 0, "other_compared": 0, "other_mismatched": 0, "positions": prompts * tokens}

    def tally(logits: torch.Tensor, completion: torch.Tensor, prefix: str) -> None:
        logits = logits.float()
        logits[..., EOS_ID] = float("-inf")
        best = logits.log_softmax(-1).topk(2, dim=-1)
        clear = ((best.values[:, 0] - best.values[:, 1]) > margin).cpu()
        counts[f"{prefix}compared"] += int(clear.sum())
        counts[f"{prefix}mismatched"] += int((clear & (best.indices[:, 0].cpu() != completion)).sum())

    trainer.model.eval()
    for prompt, output in zip(token_ids, outputs):
        completion = torch.tensor(list(output.outputs[0].token_ids))
        ids = torch.tensor([prompt + completion.tolist()], device=device)
        span = slice(len(prompt) - 1, -1)
        tally(trainer.model(ids).logits[0, span], completion, "")
        if full:
            tally(start(ids).logits[0, span], completion, "other_")
        else:
            with trainer.model.disable_adapter():  # collective too: every rank runs the same forwards
                tally(trainer.model(ids).logits[0, span], completion, "other_")
    trainer.model.train()
    return counts


class InjectedFault(RuntimeError):
    """The failure a fault run raises inside vLLM's generate."""


def fail_one_generation(trainer: Any) -> bool:
    """Run one generation through TRL's seam whose vLLM call raises (on every rank, so no collective is left
    waiting); returns whether the failure came out of the seam."""
    generation = trainer.vllm_generation
    llm = generation.llm

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise InjectedFault("injected: vLLM failed mid-generation")

    llm.generate = failing  # an instance attribute over the class's method
    try:
        generation.generate([[3, 4, 5, 6]], None, 1)
    except InjectedFault:
        return True
    finally:
        del llm.generate
    return False


def run(workdir: Path, sampling: str = "auto", steps: int = 3, fault_at: int | None = None) -> dict[str, Any]:
    """`sampling`: a LoRA run's sampling mode, or "full" / "full-fp8" (full fine-tuning, no adapter, sampled in 16
    bits / from an fp8 copy). `fault_at`: the step after which one generation fails inside vLLM."""
    from transformers import TrainerCallback

    from trl_turbo.testing.vllm_checks import build_trainer, eager_engines, logprob_gaps, randomize_adapter
    from trl_turbo.vllm.engine_plan import engine_state

    with warnings.catch_warnings(record=True) as caught, eager_engines():
        warnings.simplefilter("always")
        full = sampling.startswith("full")
        mode = {"full": None, "full-fp8": "fp8"}.get(sampling, sampling)  # turbo_vllm_sampling
        # full fine-tuning: projections of 4-32 MB per rank, as large as vLLM's allocator gives segments of their own
        # (the copies standby releases); the LoRA runs keep the tiny shape
        fp8 = {"turbo_vllm_kv_cache_dtype": "fp8", "vllm_importance_sampling_mode": "token_truncate"}
        trainer = build_trainer("llama", workdir, steps=steps, completion_cap=8, vllm_tensor_parallel_size=2,
                                lora=not full, model_shape=FULL_SHAPE if full else None,
                                **({"turbo_vllm_sampling": mode} if mode else {}),
                                **(fp8 if mode == "fp8" else {}))
    if not full:
        randomize_adapter(trainer.model)  # rank 0's values reach every rank with FSDP2's start-up broadcast
    used: list[float] = []
    fault: dict[str, Any] = {}

    class Record(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            free, total = torch.cuda.mem_get_info()
            used.append((total - free) / 2**30)
            if state.global_step == fault_at:
                fault["raised"] = fail_one_generation(trainer)
                fault["differing_right_after"] = shard_report(trainer, workdir)["differing_from_checkpoint"]

    trainer.add_callback(Record())
    trainer.train()
    logs = trainer.state.log_history
    state = engine_state(trainer.vllm_generation)
    result = {
        "sampling": ("full-fp8" if state.full_finetuning and state.fp8 is not None
                     else "merged" if state.merged is not None else "lora" if state.adapters is not None
                     else "fp8" if state.fp8 is not None else "full" if state.full_finetuning else None),
        "casts": len(state.weight_copies.casts) if state.weight_copies is not None else 0,
        "own_copy_warnings": sum("keep a copy of their own" in str(w.message) for w in caught),
        **shard_report(trainer, workdir),
        # collective: every rank runs the same forwards
        "gaps_after": trained_gaps(trainer, workdir) if full else logprob_gaps(trainer),
        "greedy": greedy_agreement(trainer, workdir, full),
        "released_copies_gib": [log["vllm/released_copies_gib"] for log in logs
                                if "vllm/released_copies_gib" in log],
        "fault": fault,
        "weight_sync_s": [log["vllm/weight_sync_s"] for log in logs if "vllm/weight_sync_s" in log],
        "shared_weights_gib": [log["vllm/shared_weights_gib"] for log in logs if "vllm/shared_weights_gib" in log],
        "parked_host_gib": [log["vllm/parked_host_gib"] for log in logs if "vllm/parked_host_gib" in log],
        "losses": [log["loss"] for log in logs if "loss" in log],
        "used_gib": used,
    }
    return result


if __name__ == "__main__":
    rank = int(os.environ.get("RANK", 0))
    faulty = len(sys.argv) > 3 and sys.argv[3] == "fault"
    result = {"rank": rank, **run(Path(sys.argv[1]) / f"rank{rank}", sys.argv[2] if len(sys.argv) > 2 else "auto",
                                  steps=20 if faulty else 3, fault_at=10 if faulty else None)}
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # skip interpreter teardown of the in-process engine
