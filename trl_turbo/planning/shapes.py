"""Named model shapes for the benchmarks and `trl-turbo plan --model`.

Design decision: a shape is a plain ``transformers`` config dict (``model_type`` plus sizes), copied from the public
``config.json`` of the real checkpoint, so a benchmark builds a randomly initialised model with exactly the real
layer sizes without downloading anything. Only what affects memory and compute is kept (sizes, head layout, vocab,
tying, RoPE base/scaling); tokenizer and generation fields are left out. ``tiny`` is a toy shape for CPU tests.
"""

from __future__ import annotations

import copy
from typing import Any

# bitsandbytes settings a benchmark can load its model with (`BitsAndBytesConfig` arguments, JSON-able)
QUANTIZATIONS: dict[str, dict[str, Any]] = {
    "none": {},
    "nf4": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": "bfloat16"},
}

# Llama 3.1 and 3.3 share their RoPE scaling (the config.json field, as published)
LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA3_ROPE_SCALING,
        "tie_word_embeddings": False,
    },
    "qwen2.5-1.5b": {
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "qwen3-8b": {
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "gemma2-9b": {
        # logit softcapping, a tied 256K vocabulary, head_dim 256, 42 layers: the family unlike the others
        "model_type": "gemma2",
        "hidden_size": 3584,
        "intermediate_size": 14336,
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
    },
    "mistral-7b": {
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 32768,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    "tiny": {
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,  # head_dim 64: a size vLLM's attention kernels take, for a GPU smoke run of e2e
        "num_key_value_heads": 1,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
}

# Llama-3.3-70B: Llama-3.1-8B's vocabulary, RoPE and head layout (8 KV heads of 128) at 70B sizes
SHAPES["llama-3.3-70b"] = {**SHAPES["llama-3.1-8b"], "hidden_size": 8192, "intermediate_size": 28672,
                           "num_hidden_layers": 80, "num_attention_heads": 64}

# SmolLM2-135M-Instruct (`tasks.smollm2`): the real weights the GPU machine can hold offline, for checks that need a
# trained model's peaked logits (greedy agreement between kernels), not for timings
SHAPES["smollm2-135m"] = {**SHAPES["tiny"], "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                          "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                          "max_position_embeddings": 8192, "rope_theta": 100000.0, "tie_word_embeddings": True}

# Qwen2.5-32B: the largest shape that FSDP2 + tensor-parallel vLLM trains on two GPUs
SHAPES["qwen2.5-32b"] = {**SHAPES["qwen2.5-1.5b"], "hidden_size": 5120, "intermediate_size": 27648,
                         "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
                         "vocab_size": 152064, "tie_word_embeddings": False}

# (hidden, vocab) pairs of the LM-head loss benchmark; `issue3` covers an untied 8B head and a tied 1.5B head.
LOSS_PRESETS: dict[str, list[tuple[int, int]]] = {
    "issue3": [(4096, 128256), (1536, 151936)],
    "tiny": [(64, 512), (32, 1000)],
}


def build_config(shape: str) -> Any:
    """Return the ``PretrainedConfig`` of a named shape (``KeyError`` listing the known names otherwise)."""
    from transformers import AutoConfig

    if shape not in SHAPES:
        raise KeyError(f"unknown shape {shape!r}; known shapes: {', '.join(sorted(SHAPES))}")
    params = copy.deepcopy(SHAPES[shape])  # transformers edits nested dicts (rope_scaling) in place
    return AutoConfig.for_model(params.pop("model_type"), **params)
