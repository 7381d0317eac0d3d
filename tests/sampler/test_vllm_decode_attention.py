"""The seam that gives trl_turbo's engine its paged decode attention (`trl_turbo.vllm.decode_attention`), on a
stand-in for vLLM's FlashAttention implementation: implementations built while an engine asks for it are marked with
the engine's longest context, their decode-only batches go to `ops.paged_decode_attention` (reading vLLM's cache
halves, e4m3 where quantized, with the layer's scales) and land in vLLM's output; every other batch, option or
engine keeps FlashAttention's own forward."""

from __future__ import annotations

import types

import pytest
import torch

from trl_turbo.ops.merge_fp8 import FP8_DTYPE, FP8_MAX
from trl_turbo.ops.paged_decode_attention import reference
from trl_turbo.vllm import decode_attention

PAGE, Q_HEADS, KV_HEADS, HEAD_DIM = 16, 4, 2, 32


class FlashAttentionImpl:
    """vLLM's FlashAttentionImpl as the seam sees it: built with its options, then called per batch."""

    calls: list[str] = []

    def __init__(self, scale: float, kv_cache_dtype: str = "auto", sliding_window: tuple | None = None):
        self.scale = scale
        self.kv_cache_dtype = kv_cache_dtype
        self.sliding_window = (-1, -1) if sliding_window is None else sliding_window
        self.alibi_slopes, self.logits_soft_cap, self.sinks = None, 0, None
        self.dcp_world_size, self.attn_type = 1, "decoder"

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        FlashAttentionImpl.calls.append("flash")
        return output.fill_(7.0)


@pytest.fixture
def impl_class(monkeypatch):
    FlashAttentionImpl.calls = []
    cls = type("Impl", (FlashAttentionImpl,), {})
    monkeypatch.setattr(cls, "__init__", decode_attention._marking(FlashAttentionImpl.__init__))
    monkeypatch.setattr(cls, "forward", decode_attention._routing(FlashAttentionImpl.forward))
    return cls


def _impl(impl_class, monkeypatch, max_len: int | None, **options):
    monkeypatch.setattr(decode_attention, "_requested_max_len", lambda: max_len)
    return impl_class(HEAD_DIM ** -0.5, **options)


def _batch(fp8: bool, *, lengths=(5, 40, 0), padded: int = 4, query_len: int = 1, seed: int = 0):
    """A decode batch as vLLM hands it: padded query and output rows, the layer's [blocks, 2, page, Hkv, D] cache
    (bytes where e4m3), its scales, and the metadata's block table and lengths."""
    generator = torch.Generator().manual_seed(seed)
    blocks = 3 * len(lengths) + 1
    kv = torch.randn(blocks, 2, PAGE, KV_HEADS, HEAD_DIM, generator=generator)
    query = torch.randn(padded, Q_HEADS, HEAD_DIM, generator=generator)
    layer = types.SimpleNamespace(_q_scale=torch.tensor(1.0), _k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0))
    if fp8:
        layer._k_scale = layer._v_scale = (kv.abs().max() / FP8_MAX).float()
        kv = (kv / layer._k_scale).to(FP8_DTYPE).view(torch.uint8)  # vLLM's fp8 cache is bytes
        layer._q_scale = (query.abs().max() / FP8_MAX).float()
        query = (query / layer._q_scale).to(FP8_DTYPE)  # vLLM quantizes the query for FA3
    else:
        kv, query = kv.to(torch.bfloat16), query.to(torch.bfloat16)
    table = torch.randperm(blocks, generator=generator)[: 3 * len(lengths)].reshape(len(lengths), 3).to(torch.int32)
    metadata = types.SimpleNamespace(num_actual_tokens=len(lengths), max_query_len=query_len, use_cascade=False,
                                     causal=True, block_table=table, seq_lens=torch.tensor(lengths, dtype=torch.int32))
    output = torch.full((padded, Q_HEADS * HEAD_DIM), -1.0, dtype=torch.bfloat16)
    return layer, query, kv, metadata, output


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_marked_engines_decode_batches_take_the_kernel_into_vllms_output(impl_class, monkeypatch, fp8):
    impl = _impl(impl_class, monkeypatch, 128, kv_cache_dtype="fp8" if fp8 else "auto")
    assert getattr(impl, decode_attention.MARK) == 128
    layer, query, kv, metadata, output = _batch(fp8)
    result = impl.forward(layer, query, None, None, kv, metadata, output)
    assert result is output and FlashAttentionImpl.calls == []
    keys, values = kv.unbind(1)
    scales = {}
    if fp8:
        keys, values = keys.view(FP8_DTYPE), values.view(FP8_DTYPE)
        scales = {"q_scale": layer._q_scale, "k_scale": layer._k_scale, "v_scale": layer._v_scale}
    expected = reference(query[:3], keys, values, metadata.block_table, metadata.seq_lens,
                         softmax_scale=HEAD_DIM ** -0.5, out=torch.empty(3, Q_HEADS, HEAD_DIM), **scales)
    written = output[:3].float().view(3, Q_HEADS, HEAD_DIM)
    torch.testing.assert_close(written, expected, atol=2e-2, rtol=2e-2)
    assert torch.count_nonzero(written[2]) == 0  # an empty sequence
    assert torch.equal(output[3], torch.full_like(output[3], -1.0))  # the padding row is left alone


def test_other_batches_options_and_engines_keep_flash_attention(impl_class, monkeypatch):
    marked = _impl(impl_class, monkeypatch, 128)
    layer, query, kv, metadata, output = _batch(False, query_len=2)  # a prefill or mixed batch
    marked.forward(layer, query, None, None, kv, metadata, output)
    layer, query, kv, metadata, output = _batch(False)
    marked.forward(layer, query, None, None, kv, types.SimpleNamespace(**{**vars(metadata), "use_cascade": True}),
                   output)
    marked.forward(layer, query, None, None, kv, None, output)  # vLLM's profiling run
    marked.forward(layer, query, None, None, kv, metadata, output, output_scale=torch.ones(1))
    windowed = _impl(impl_class, monkeypatch, 128, sliding_window=(31, 0))
    windowed.forward(layer, query, None, None, kv, metadata, output)
    plain = _impl(impl_class, monkeypatch, None)
    assert not hasattr(plain, decode_attention.MARK)
    plain.forward(layer, query, None, None, kv, metadata, output)
    assert FlashAttentionImpl.calls == ["flash"] * 6


def test_the_request_is_an_engine_argument_vllm_hashes():
    assert decode_attention.engine_arguments() == {
        "additional_config": {decode_attention.ENGINE_KEY: decode_attention.PAGED_TRITON}}
