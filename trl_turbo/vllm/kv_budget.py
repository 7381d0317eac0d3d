"""How much device memory vLLM's KV cache may take when it stands by during training.

Design: with standby, the KV cache is released before each training phase, so it never competes with training
activations; it only has to fit next to what persists through generation: the (shared) weights, the trainable
parameters with their gradients and optimizer states, and vLLM's own sampling workspace. At engine start the
training model is on the device but its optimizer states are not yet allocated, and (for shared weights) vLLM's
copy of the weights exists until the HF model is pointed at it. So: KV = free − vLLM's weights − trainable state
− sampling workspace − a safety margin, and never more than all scheduled sequences can fill. A sequence is as long
as `vllm_max_model_length` when the user set it; otherwise as the completion cap plus a prompt allowance (the model's
full context, often 128K tokens, would claim nearly the whole free memory for a cache GRPO never fills), but vLLM
still needs room for one sequence of its full `max_model_len` to start.
"""

from __future__ import annotations

from ..device_memory import kept_free_bytes

_GIB = 2**30
# Per trainable parameter: its fp32 gradient, and Adam's two fp32 moments but for the share that waits on the host
# (`turbo_offload_optimizer_states`)
_GRADIENT_BYTES_PER_PARAM = 4
_ADAM_STATE_BYTES_PER_PARAM = 4 + 4
# The margin: 5% of the device, at least 2 GiB, the floor at most a tenth of a small device (a 5 GiB run would
# otherwise keep 40% of it)
_MARGIN_FRACTION = 0.05
_MIN_MARGIN_BYTES = 2 * _GIB
_MIN_KV_BYTES = 1 * _GIB
# The scheduler's token budget per step that TRL's colocated engine is built with (`max_num_batched_tokens`)
VLLM_BATCHED_TOKENS = 4096
# vLLM's KV page (block) size for the attention backends of the families trl_turbo supports
KV_BLOCK_TOKENS = 16
# Prompt tokens assumed per sequence when `vllm_max_model_length` is unset (GRPO prompts are rarely longer).
PROMPT_ALLOWANCE_TOKENS = 2048


def auto_kv_cache_bytes(*, free_bytes: int, total_bytes: int, vllm_weight_bytes: int, trainable_params: int,
                        sampling_workspace_bytes: int, useful_bytes: int, states_on_host: float = 0.0) -> int:
    """The KV cache budget in bytes: what is left, capped at `useful_bytes` (every sequence at full length); raises
    ValueError when less than min(1 GiB, useful) is left, naming what took the memory. `states_on_host`: the share
    of the optimizer's states that waits on the host between steps."""
    margin = kv_margin_bytes(total_bytes)
    per_param = _GRADIENT_BYTES_PER_PARAM + (1.0 - states_on_host) * _ADAM_STATE_BYTES_PER_PARAM
    reserved = vllm_weight_bytes + round(trainable_params * per_param) + sampling_workspace_bytes + margin
    budget = free_bytes - reserved
    if budget < min(_MIN_KV_BYTES, useful_bytes):
        raise ValueError(
            f"Not enough device memory for vLLM's KV cache: {free_bytes / _GIB:.1f} GiB free, of which "
            f"{vllm_weight_bytes / _GIB:.1f} GiB go to vLLM's weights, "
            f"{trainable_params * per_param / _GIB:.1f} GiB to trainable parameters and their "
            f"optimizer states, {sampling_workspace_bytes / _GIB:.1f} GiB to sampling and {margin / _GIB:.1f} GiB "
            "kept as margin. Use a smaller model or set `vllm_gpu_memory_utilization` explicitly."
        )
    return int(min(budget, useful_bytes))


def kv_margin_bytes(total_bytes: int) -> int:
    """Device memory the KV budget leaves free: 5% of the device, and at least 2 GiB or 10% of it, the smaller."""
    return kept_free_bytes(total_bytes, _MARGIN_FRACTION, _MIN_MARGIN_BYTES)


def rank_kv_heads(kv_heads: int, tp: int) -> int:
    """The key/value heads one tensor-parallel rank holds: its share, or one replicated head where there are fewer
    heads than ranks."""
    return max(1, kv_heads // tp)


def kv_bytes_per_token(*, layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of every layer for one token."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def useful_kv_cache_bytes(*, max_num_seqs: int, seq_len: int, max_model_len: int, per_token_bytes: int) -> int:
    """KV memory that lets every scheduled sequence reach `seq_len` tokens (more is never used): each sequence's
    pages of `KV_BLOCK_TOKENS`, rounded up, and one spare page (a scheduler that plans a step ahead holds one more
    token), plus vLLM's one reserved page; at least one sequence of `max_model_len` tokens, the least vLLM starts
    with."""
    pages = max_num_seqs * (-(-min(seq_len, max_model_len) // KV_BLOCK_TOKENS) + 1) + 1
    one_full_sequence = -(-max_model_len // KV_BLOCK_TOKENS) + 1
    return max(pages, one_full_sequence) * KV_BLOCK_TOKENS * per_token_bytes


def expected_seq_len(*, max_model_length: int | None, max_completion_length: int) -> int:
    """Longest sequence a GRPO generation is expected to hold: the user's `vllm_max_model_length` when set."""
    return max_model_length or max_completion_length + PROMPT_ALLOWANCE_TOKENS


def sampling_workspace_bytes(max_num_seqs: int, vocab_size: int, hidden_size: int,
                             max_num_batched_tokens: int = VLLM_BATCHED_TOKENS) -> int:
    """vLLM's activation peak for one scheduler step: a few hidden states of the step's tokens, and fp32 logits of
    the rows it samples (one per sequence: vLLM computes logits only where a token is sampled) with their
    log-softmax and sampling probabilities."""
    return max_num_batched_tokens * 16 * hidden_size * 4 + 3 * max_num_seqs * vocab_size * 4
