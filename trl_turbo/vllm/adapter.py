"""The PEFT adapter as vLLM's LoRA manager takes it: names, tensors, engine limits.

Design: vLLM parses PEFT checkpoint names (`base_model.model.<module>.lora_A.weight`) and packs q/k/v and gate/up
itself, so the adapter is handed over exactly as PEFT would save it (`get_peft_model_state_dict`), minus the file.
The tensors are cloned: vLLM scales `lora_B` in place while packing, which must never touch the training
parameters. What vLLM cannot serve (DoRA, trained biases, `modules_to_save`, a rank above its largest slot size)
is named at config time.
"""

from __future__ import annotations

from typing import Any

import torch

from ..sharding.dtensor import whole_of

# vLLM's `LoRAConfig.max_lora_rank` accepts only these values.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def active_adapter(model: Any) -> str | None:
    """The live adapter's name of a PEFT model; None for a model trained whole (full fine-tuning)."""
    return getattr(model, "active_adapter", None) if hasattr(model, "peft_config") else None


def adapter_problems(peft_config: Any) -> list[str]:
    """Why vLLM cannot run this LoRA adapter from tensors (empty when it can)."""
    problems = []
    if type(peft_config).__name__ != "LoraConfig":
        problems.append(f"the adapter is a {type(peft_config).__name__}; only LoRA adapters can go to vLLM")
        return problems
    if getattr(peft_config, "use_dora", False):
        problems.append("DoRA (`use_dora=True`) is not supported by vLLM's LoRA layers")
    if getattr(peft_config, "bias", "none") != "none":
        problems.append(f"trained biases (`bias={peft_config.bias!r}`) are not supported by vLLM's LoRA layers")
    if getattr(peft_config, "modules_to_save", None):
        problems.append(f"`modules_to_save={peft_config.modules_to_save}` trains full modules, which vLLM cannot "
                        "take as an adapter")
    ranks = [peft_config.r, *(getattr(peft_config, "rank_pattern", None) or {}).values()]
    if max(ranks) > VLLM_LORA_RANKS[-1]:
        problems.append(f"LoRA rank {max(ranks)} is above vLLM's largest ({VLLM_LORA_RANKS[-1]})")
    return problems


def lora_engine_kwargs(peft_config: Any) -> dict[str, Any]:
    """`vllm.LLM` arguments that reserve one adapter slot of the adapter's rank."""
    rank = max([peft_config.r, *(getattr(peft_config, "rank_pattern", None) or {}).values()])
    slot_rank = next(r for r in VLLM_LORA_RANKS if r >= rank)
    return {"enable_lora": True, "max_lora_rank": slot_rank, "max_loras": 1, "max_cpu_loras": 1}


def adapter_tensors(peft_model: Any, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's checkpoint names, detached copies; FSDP2's shards are gathered whole
    (collective: every rank calls it, in the same order)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model, adapter_name=adapter_name)
    return {name: whole_of(tensor).detach().clone() for name, tensor in state.items()}



def adapter_config_dict(peft_config: Any) -> dict[str, Any]:
    """The adapter's config as vLLM's `PEFTHelper.from_dict` reads it."""
    config = peft_config.to_dict()
    target_modules = config.get("target_modules")
    if isinstance(target_modules, set):
        config["target_modules"] = sorted(target_modules)
    return config
