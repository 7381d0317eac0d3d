"""The `unsloth` variants' child of `bench e2e`: Unsloth's GRPO recipe, measured like every other variant.

Design decision: run by this file's path with Unsloth's site directory first on ``PYTHONPATH`` (`peers`), so that
``import unsloth`` is the first import: it patches transformers, TRL and peft as they load. Then the package's bench
helpers are imported; trl_turbo stays unpatched (Unsloth's TRL is outside trl_turbo's versions, and
`set_patched(False)` makes sure). The recipe is the one in Unsloth's GRPO notebooks: `FastLanguageModel` with its
vLLM engine (`fast_inference=True`, standby), `get_peft_model` with its own gradient checkpointing, and TRL's
GRPOTrainer as Unsloth patches it; the workload (batch, lengths, reward, seed) is the common one (`e2e.grpo_kwargs`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

# the repository, not this file's folder, whose modules (train, loss, results, ...) would shadow others' imports
sys.path[0] = str(Path(__file__).resolve().parents[2])

import unsloth  # noqa: E402, F401  (first: it patches transformers, TRL and peft as they are imported)


def run_unsloth(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from trl import GRPOConfig, GRPOTrainer
    from unsloth import FastLanguageModel
    from vllm import SamplingParams

    from trl_turbo.bench import e2e, peers, set_patched

    set_patched(False)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    settings = peers.PEER_VARIANTS[spec["variant"]]
    lora = spec["lora"]
    tokenizer = e2e.load_tokenizer(spec["checkpoint"])
    dataset = e2e.workload_dataset(spec, tokenizer)  # outside the timed start-up, as for every variant

    def build() -> Any:
        model, _ = FastLanguageModel.from_pretrained(
            model_name=spec["checkpoint"], max_seq_length=spec["prompt_len"] + spec["completion_len"],
            dtype=torch.bfloat16, load_in_4bit=spec["quantization"] != "none", fast_inference=True,
            max_lora_rank=lora["r"], gpu_memory_utilization=peers.GPU_MEMORY_UTILIZATION, **settings)
        model = FastLanguageModel.get_peft_model(
            model, r=lora["r"], lora_alpha=lora["alpha"], target_modules=list(peers.LORA_TARGETS),
            use_gradient_checkpointing="unsloth", random_state=spec["seed"])
        # TRL's sampling defaults, every completion to the cap (the other variants' `generation_kwargs`)
        sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, ignore_eos=True,
                                  max_tokens=spec["completion_len"], seed=spec["seed"])
        config = GRPOConfig(**e2e.grpo_kwargs(spec), vllm_sampling_params=sampling)
        return GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=e2e.hashed_reward, args=config,
                           train_dataset=dataset)

    def describe(trainer: Any, row: dict[str, Any]) -> None:
        if getattr(trainer, "vllm_generation", None) is None:  # the timers every variant is measured with sit there
            raise RuntimeError("Unsloth's GRPOTrainer has no `vllm_generation`: its generation cannot be timed as "
                               "the other variants' is")
        engine = getattr(trainer.vllm_generation, "llm", None)
        cache = getattr(getattr(getattr(engine, "llm_engine", None), "vllm_config", None), "cache_config", None)
        row["versions"] = peers.versions()
        row["unsloth_settings"] = {**settings, "use_gradient_checkpointing": "unsloth",
                                   "gpu_memory_utilization_asked": peers.GPU_MEMORY_UTILIZATION,
                                   "gpu_memory_utilization": getattr(cache, "gpu_memory_utilization", None),
                                   "standby": os.environ.get("UNSLOTH_VLLM_STANDBY")}

    return e2e.measure(spec, device, build, describe, e2e.new_row(spec))


if __name__ == "__main__":
    from trl_turbo.bench.e2e import child_main

    child_main(sys.argv[1], run_unsloth)
