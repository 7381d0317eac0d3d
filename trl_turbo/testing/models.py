"""Tiny, randomly initialised causal LMs of real Hugging Face architectures, built offline.

Design decision: every model comes from ``AutoConfig.for_model(model_type, ...)`` + ``AutoModelForCausalLM.from_config``
so the modelling code under test is exactly the library's (norms, rotary, GQA, softcapping, tied embeddings as each
family defaults), only shrunk: ``heads = hidden_size // HEAD_DIM`` query heads over half as many key/value heads, so
grouped-query attention is exercised, and an explicit ``head_dim`` because several families default to 128/256
regardless of hidden size. Weights are drawn under ``torch.manual_seed(seed)`` so a given call is reproducible. The
special-token ids default to those of :func:`trl_turbo.testing.tokenizer.build_tokenizer` (families disagree on
theirs, e.g. Gemma's eos is 1), so a model and the testbed tokenizer always agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from trl_turbo.families import MODEL_TYPES
from trl_turbo.testing.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB, build_tokenizer

ARCHITECTURES: tuple[str, ...] = MODEL_TYPES
# Families outside trl_turbo's shared-weight layouts, built only for the checks of vLLM's separate copy.
SEPARATE_COPY_ARCHITECTURES: tuple[str, ...] = ("phi3",)
HEAD_DIM = 8


def tiny_model(
    arch: str,
    *,
    vocab_size: int,
    hidden_size: int = 32,
    layers: int = 2,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **overrides: Any,
) -> PreTrainedModel:
    """Build a randomly initialised ``arch`` causal LM; ``overrides`` are passed to the config last and win."""
    known = ARCHITECTURES + SEPARATE_COPY_ARCHITECTURES
    if arch not in known:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {known}")
    if hidden_size % (2 * HEAD_DIM):
        raise ValueError(f"hidden_size must be a multiple of {2 * HEAD_DIM}, got {hidden_size}")
    heads = hidden_size // HEAD_DIM
    settings: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 512,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }
    if arch in ("gemma2", "gemma3_text"):
        # Alternate sliding/full attention as the real checkpoints do, with a window short enough to matter.
        settings["sliding_window"] = 16
    if arch == "gemma2":
        settings["query_pre_attn_scalar"] = HEAD_DIM
    settings.update(overrides)
    config = AutoConfig.for_model(arch, **settings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model


def tiny_model_dir(arch: str, path: str | Path, **model_kwargs: Any) -> str:
    """Save ``tiny_model(arch)`` and the testbed tokenizer to ``path`` so TRL can be given a local path string."""
    tokenizer = build_tokenizer()
    model = tiny_model(arch, vocab_size=len(VOCAB), **model_kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
