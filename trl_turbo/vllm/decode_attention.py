"""Decode steps of trl_turbo's sampling engine through its own paged attention kernel
(`ops.paged_decode_attention`), every other batch through vLLM's FlashAttention.

Design decisions:
- The engine asks for it by an engine argument (`engine_request`, under `ENGINE_KEY`), which vLLM hashes into the
  key of its compiled-graph cache, as `vllm.fp8_kernel` does for its GEMM. FlashAttention's `__init__` marks each
  attention implementation of an engine that asked (with the engine's `max_model_len`: the kernel's grid must cover
  every context a CUDA graph replays), and `forward` sends a marked implementation's decode-only batches (one query
  token per sequence, no cascade, no context parallelism, no batch invariance, one scale per tensor, a head size and
  device the Triton kernel takes, none of the options it does not implement: sliding windows, ALiBi, soft caps,
  sinks) to the kernel. Both are replaced once, through the registry.
- Every launch takes the kernel's default cut for the batch size and the engine's longest context, never for the
  batch's own contexts: a CUDA graph replays its capture (one per batch size) on every later context, and the eager
  warm-up runs before a capture compile the very kernel the capture launches (Triton compiling inside a capture
  would fail). Each sequence cuts its own context into the launch's runs inside the kernel.
- The kernel reads what FA3 reads: the query as vLLM hands it (e4m3 under the layer's query scale where the KV cache
  is e4m3), the two halves of the layer's cache (viewed as e4m3 where quantized) with the layer's scales, the block
  table and the sequence lengths; it writes into vLLM's output.
- Only where full CUDA graphs serve decode-only batches alone (vLLM's default FULL_AND_PIECEWISE, or
  FULL_DECODE_ONLY): under FULL a mixed batch replays a graph whose attention was routed at capture.
- A candidate, not what training samples with: nothing in the run plan asks for it until it beats FA3 inside the
  engine (`bench engine-options --options bf16,bf16-turbo-attention`; docs/benchmarks.md has what was measured).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from .. import registry
from ..ops.paged_decode_attention import kernel_serves, paged_decode_attention
from . import engine_request

ENGINE_KEY = "trl_turbo_decode_attention"
PAGED_TRITON = "paged_triton"
MARK = "_trl_turbo_decode_attention_max_len"


def engine_arguments() -> dict[str, Any]:
    """The engine arguments that select this kernel for decode steps."""
    return engine_request.arguments(ENGINE_KEY, PAGED_TRITON)


def _flash_attention_impl() -> type:
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    return FlashAttentionImpl


def _current_vllm_config() -> Any:
    return engine_request.current_config()


def mixed_batches_full_graphed(config: Any) -> bool:
    """Whether the engine replays full CUDA graphs for mixed prefill and decode batches (`cudagraph_mode` FULL): a
    graph captured over a decode-only batch would then replay the kernel on prefill rows."""
    mode = getattr(getattr(config, "compilation_config", None), "cudagraph_mode", None)
    return getattr(mode, "name", None) == "FULL"


def requested_max_len(config: Any) -> int | None:
    """The engine's `max_model_len` where the engine `config` describes asked for the kernel and replays full graphs
    for decode-only batches only, else None (FA3 everywhere, said once)."""
    if not engine_request.asked(config, ENGINE_KEY, PAGED_TRITON):
        return None
    if mixed_batches_full_graphed(config):
        _warn_once("trl_turbo: the decode attention kernel stays off: this engine's cudagraph_mode FULL replays one "
                   "graph for decode-only and mixed batches; FULL_AND_PIECEWISE (vLLM's default) lets it serve.")
        return None
    return int(config.model_config.max_model_len)


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def _marking(init: Any) -> Any:
    @functools.wraps(init)
    def marked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        max_len = requested_max_len(_current_vllm_config())
        if max_len is not None:
            setattr(self, MARK, max_len)

    return marked_init


def _kernel_serves(impl: Any, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor, metadata: Any,
                   output_scale: Any) -> bool:
    """A decode-only batch of plain causal attention that the Triton kernel runs: the attention FA3 computes, up to
    rounding (with an e4m3 cache FA3 rounds the probabilities to e4m3, the kernel to fp16)."""
    window = getattr(impl, "sliding_window", None)
    scales = [getattr(layer, name, None) for name in ("_q_scale", "_k_scale", "_v_scale")]
    return (metadata is not None and output_scale is None and getattr(metadata, "max_query_len", None) == 1
            and not getattr(metadata, "use_cascade", False) and getattr(metadata, "causal", True) is True
            and getattr(impl, "dcp_world_size", 1) == 1 and getattr(impl, "attn_type", "decoder") == "decoder"
            and window in (None, (-1, -1), [-1, -1]) and getattr(impl, "alibi_slopes", None) is None
            and not getattr(impl, "logits_soft_cap", None) and getattr(impl, "sinks", None) is None
            and not getattr(impl, "batch_invariant_enabled", False)
            and all(scale is None or scale.numel() == 1 for scale in scales)  # not per-head scales
            and kernel_serves(query, kv_cache))


def decode(impl: Any, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor, metadata: Any,
           output: torch.Tensor, max_len: int) -> torch.Tensor:
    """The kernel on one decode batch, written into `output` as FA3 would write it, cut for the batch size and the
    engine's longest context (`max_len`)."""
    tokens = metadata.num_actual_tokens
    key_cache, value_cache = kv_cache.unbind(1)
    scales: dict[str, torch.Tensor] = {}
    if query.element_size() == 1:
        scales["q_scale"] = layer._q_scale
    if str(getattr(impl, "kv_cache_dtype", "auto")).startswith("fp8"):
        fp8 = query.dtype if query.element_size() == 1 else torch.float8_e4m3fn
        key_cache, value_cache = key_cache.view(fp8), value_cache.view(fp8)
        scales.update(k_scale=layer._k_scale, v_scale=layer._v_scale)
    out = output[:tokens].view(tokens, query.shape[1], query.shape[2])
    paged_decode_attention(query[:tokens], key_cache, value_cache, metadata.block_table[:tokens],
                           metadata.seq_lens[:tokens], softmax_scale=impl.scale, max_seq_len=max_len, out=out,
                           **scales)
    return output


def _routing(forward: Any) -> Any:
    @functools.wraps(forward)
    def routed_forward(self: Any, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor, output_scale: Any = None,
                       output_block_scale: Any = None) -> torch.Tensor:
        max_len = getattr(self, MARK, None)
        if max_len is None or output_block_scale is not None or not _kernel_serves(
                self, layer, query, kv_cache, attn_metadata, output_scale):
            return forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                           output_block_scale)
        return decode(self, layer, query, kv_cache, attn_metadata, output, max_len)

    return routed_forward


def install() -> None:
    """Replace FlashAttention's `__init__` and `forward` (once; `trl_turbo.unpatch()` restores them)."""
    impl = _flash_attention_impl()
    if registry.original(impl, "forward") is not impl.__dict__["forward"]:
        return  # installed already
    registry.set_attr(impl, "__init__", _marking(impl.__dict__["__init__"]))
    registry.set_attr(impl, "forward", _routing(impl.__dict__["forward"]))
