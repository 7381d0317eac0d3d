"""The physical floor of a GRPO step's phases: generation against the GPU's read bandwidth, training against its
peak bf16 FLOP/s.

Design decision: at GRPO batch sizes a decode step is memory-bound. It must read every weight it multiplies by
once: the decoder layers' linear weights and the LM head, in the dtype the engine samples with. The embedding table
is read only at the rows it gathers, and norms are negligible, so neither is counted. It must also read the KV cache
of the live sequences. So a generation's decode floor is (C x weight bytes + the KV bytes of every step) / read
bandwidth. A tensor-parallel rank holds 1/T of both and reads them in parallel with the others, so the floor is one
rank's bytes. Prefill is compute-bound: 2 FLOPs per weight per prompt token plus causal attention, at peak FLOP/s.
The training phase's model FLOPs are one forward and one backward of every sequence:
- forward: 2 per linear weight per token;
- input gradients: another 2 per weight per token;
- weight gradients: 2 more, only for trained weights (an adapter's are negligible);
- causal attention: 2·S²·width per layer forward, twice that backward.
Recomputation and extra log-prob passes are not model FLOPs, so the model FLOP utilization (MFU) is comparable
across variants. Every function is pure: the bench measures the bandwidth and FLOP/s and reads the times.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..vllm.kv_budget import kv_bytes_per_token, rank_kv_heads
from .model_spec import ModelSpec, four_bit_bytes_per_weight

# Bytes per linear weight of the decoder layers in each sampled dtype; the LM head stays 16-bit (vLLM's fp8 and
# bitsandbytes layers leave it unquantized).
LAYER_WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0, "nf4": four_bit_bytes_per_weight(nested=False)}


@dataclass(frozen=True)
class Generation:
    """One generation of one tensor-parallel group: `sequences` in all (a rank's prompts x generations, times the
    ranks of its group, whose prompts TRL gathers), each `prompt_len` + `completion_len` tokens long."""

    sequences: int
    prompt_len: int
    completion_len: int
    tp: int = 1
    weight_dtype: str = "bf16"  # "bf16", "fp8" or "nf4": how the engine holds the decoder layers' linear weights
    kv_bytes: int = 2  # per cached value: 2 in 16-bit, 1 in fp8
    adapter_parameters: int = 0  # LoRA factors the engine reads unmerged ("lora" sampling), else 0


def lm_head_parameters(spec: ModelSpec) -> int:
    return spec.vocab_size * spec.hidden_size


def decode_weight_bytes(spec: ModelSpec, generation: Generation) -> float:
    """What one rank reads of the weights in one decode step."""
    lm_head = lm_head_parameters(spec) * 2
    layers = spec.layer_linear_parameters * LAYER_WEIGHT_BYTES[generation.weight_dtype]
    return (layers + lm_head + 2 * generation.adapter_parameters) / generation.tp


def rank_kv_bytes_per_token(spec: ModelSpec, generation: Generation) -> int:
    """One rank's KV bytes for one cached token (its key/value heads)."""
    return kv_bytes_per_token(layers=spec.layers, kv_heads=rank_kv_heads(spec.key_value_heads, generation.tp),
                              head_dim=spec.head_dim, dtype_bytes=generation.kv_bytes)


def decode_bytes(spec: ModelSpec, generation: Generation) -> float:
    """One rank's bytes read over the generation's decode steps (the prefill samples the first completion token,
    then one step per further token): the weights at every step, and at step t = 1..C-1 the KV cache of every
    sequence's prompt and first t completion tokens."""
    steps = max(0, generation.completion_len - 1)
    cached_tokens = generation.sequences * (steps * generation.prompt_len + steps * (steps + 1) / 2)
    return steps * decode_weight_bytes(spec, generation) + cached_tokens * rank_kv_bytes_per_token(spec, generation)


def prefill_flops(spec: ModelSpec, generation: Generation) -> float:
    """One rank's FLOPs of the prompts' prefill (the group's prompts, 1/T of the work on each rank): every prompt
    token through the decoder layers' linear weights, causal attention over the prompt, and the LM head for the last
    token only (the one that samples)."""
    prompt = generation.prompt_len
    per_sequence = (2 * spec.layer_linear_parameters * prompt + 2 * spec.layers * prompt * prompt * spec.query_width
                    + 2 * lm_head_parameters(spec))
    return generation.sequences * per_sequence / generation.tp


def generation_floor_s(spec: ModelSpec, generation: Generation, read_bytes_per_s: float,
                       flops_per_s: float) -> float:
    """The shortest a generation can take: its decode bytes at the read bandwidth plus its prefill at peak FLOP/s."""
    return decode_bytes(spec, generation) / read_bytes_per_s + prefill_flops(spec, generation) / flops_per_s


def training_flops(spec: ModelSpec, sequences: int, sequence_len: int, full_finetuning: bool) -> float:
    """One rank's model FLOPs for one forward and backward of `sequences` sequences of `sequence_len` tokens: the
    forward, the input gradients (as much again for the linear weights, twice the forward for attention) and, when
    every weight trains, the weight gradients."""
    linear = 2 * (spec.layer_linear_parameters + lm_head_parameters(spec)) * sequence_len
    attention = 2 * spec.layers * sequence_len * sequence_len * spec.query_width
    per_sequence = linear * (3 if full_finetuning else 2) + attention * 3
    return sequences * per_sequence
