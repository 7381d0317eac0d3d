"""The colocated vLLM engine samples in the training precision.

TRL builds `vllm.LLM(...)` without a dtype, so vLLM takes the checkpoint's (usually bf16) even when training runs
in fp16: a sampler/trainer precision mismatch of exactly the kind fp16 RL training is meant to remove (arXiv
2510.26788). Seam: `VLLMGeneration._init_vllm`. For the duration of that call, the module attribute `LLM` it
constructs from is wrapped to add `dtype` (an explicit dtype from TRL would win). Nothing else about the engine
changes.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from ..config import TurboFields
from . import registry
from .trl_trainer_init import constructing_config

_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


def vllm_dtype(generation: Any) -> str | None:
    """The dtype vLLM should use for a `VLLMGeneration` built by a GRPOTrainer, or None to leave TRL's choice."""
    config = constructing_config()
    enabled = getattr(config, "turbo_vllm_match_precision", TurboFields.turbo_vllm_match_precision)
    if not enabled or generation.mode != "colocate":
        return None
    return _DTYPES.get(str(generation.accelerator.mixed_precision))


def _wrap_init_vllm(original):
    @functools.wraps(original)
    def _init_vllm(self):
        dtype = vllm_dtype(self)
        module = sys.modules[original.__module__]
        llm_cls = getattr(module, "LLM", None)
        if dtype is None or llm_cls is None:
            return original(self)

        def llm_in_training_precision(*args, **kwargs):
            return llm_cls(*args, **{"dtype": dtype, **kwargs})

        module.LLM = llm_in_training_precision
        try:
            return original(self)
        finally:
            module.LLM = llm_cls

    return _init_vllm


def apply() -> None:
    from trl.generation.vllm_generation import VLLMGeneration

    registry.set_attr(VLLMGeneration, "_init_vllm", _wrap_init_vllm(VLLMGeneration.__dict__["_init_vllm"]))
