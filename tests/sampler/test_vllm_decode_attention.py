"""The seam that gives trl_turbo's engine its paged decode attention (`trl_turbo.vllm.decode_attention`), on a
stand-in for vLLM's FlashAttention implementation: implementations built while an engine asks for it are marked with
the engine's longest context, their decode-only batches go to `ops.paged_decode_attention` (reading vLLM's cache
halves, e4m3 where quantized, with the layer's scales) and land in vLLM's output; every other batch, option or
engine keeps FlashAttention's own forward."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from trl_turbo.ops.merge_fp8 import FP8_DTYPE, FP8_MAX
from trl_turbo.ops.paged_decode_attention import reference
from trl_turbo.vllm import decode_attention

PAGE, Q_HEADS, KV_HEADS, HEAD_DIM = 16, 4, 2, 32
# The kernel serves CPU tensors only under the interpreter (the CPU suite); on a GPU machine the batch is on the GPU
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class FlashAttentionImpl:
    """vLLM's FlashAttentionImpl as the seam sees it: built with its options, then called per batch."""

    calls: list[str] = []

    def __init__(self, scale: float, kv_cache_dtype: str = "auto", sliding_window: tuple | None = None, **other):
        self.scale = scale
        self.kv_cache_dtype = kv_cache_dtype
        self.sliding_window = (-1, -1) if sliding_window is None else sliding_window
        self.alibi_slopes, self.logits_soft_cap, self.sinks = None, 0, None
        self.dcp_world_size, self.attn_type, self.batch_invariant_enabled = 1, "decoder", False

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


def _engine_config(max_len: int | None) -> types.SimpleNamespace:
    """The current vLLM config while an engine builds its layers: asking for the kernel, or not."""
    additional = {decode_attention.ENGINE_KEY: decode_attention.PAGED_TRITON} if max_len is not None else {}
    return types.SimpleNamespace(additional_config=additional,
                                 model_config=types.SimpleNamespace(max_model_len=max_len or 4096))


def _impl(impl_class, monkeypatch, max_len: int | None, **options):
    monkeypatch.setattr(decode_attention, "_current_vllm_config", lambda: _engine_config(max_len))
    impl = impl_class(HEAD_DIM ** -0.5, **options)
    for name, value in options.items():  # options the stand-in's constructor does not take
        setattr(impl, name, value)
    return impl


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
                                     causal=True, block_table=table, seq_lens=torch.tensor(lengths, dtype=torch.int32),
                                     max_seq_len=max(lengths))
    output = torch.full((padded, Q_HEADS * HEAD_DIM), -1.0, dtype=torch.bfloat16)
    for name, value in vars(layer).items():
        setattr(layer, name, value.to(DEVICE))
    metadata.block_table, metadata.seq_lens = metadata.block_table.to(DEVICE), metadata.seq_lens.to(DEVICE)
    return layer, query.to(DEVICE), kv.to(DEVICE), metadata, output.to(DEVICE)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_marked_engines_decode_batches_take_the_kernel_into_vllms_output(impl_class, monkeypatch, fp8):
    if fp8 and DEVICE.type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 in hardware needs compute capability 8.9 (the seam keeps FA3 below it)")
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
                         softmax_scale=HEAD_DIM ** -0.5, out=torch.empty(3, Q_HEADS, HEAD_DIM, device=DEVICE), **scales)
    written = output[:3].float().view(3, Q_HEADS, HEAD_DIM)
    torch.testing.assert_close(written, expected, atol=2e-2, rtol=2e-2)
    assert torch.count_nonzero(written[2]) == 0  # an empty sequence
    assert torch.equal(output[3], torch.full_like(output[3], -1.0))  # the padding row is left alone


def test_other_batches_options_and_engines_keep_flash_attention(impl_class, monkeypatch):
    marked = _impl(impl_class, monkeypatch, 128)
    layer, query, kv, metadata, output = _batch(False, query_len=2)  # a prefill or mixed batch
    marked.forward(layer, query, None, None, kv, metadata, output)
    layer, query, kv, metadata, output = _batch(False)
    for change in ({"use_cascade": True}, {"causal": torch.ones(3, dtype=torch.bool)}):  # cascade; FA4's causal
        marked.forward(layer, query, None, None, kv, types.SimpleNamespace(**{**vars(metadata), **change}), output)
    marked.forward(layer, query, None, None, kv, None, output)  # vLLM's profiling run
    marked.forward(layer, query, None, None, kv, metadata, output, output_scale=torch.ones(1))
    marked.forward(layer, query, None, None, kv, metadata, output, output_block_scale=torch.ones(1))
    options = [{"sliding_window": (31, 0)}, {"alibi_slopes": torch.ones(Q_HEADS)}, {"logits_soft_cap": 30.0},
               {"sinks": torch.zeros(Q_HEADS)}, {"dcp_world_size": 2}, {"batch_invariant_enabled": True},
               {"attn_type": "encoder_decoder"}]
    for option in options:
        _impl(impl_class, monkeypatch, 128, **option).forward(layer, query, None, None, kv, metadata, output)
    per_head = types.SimpleNamespace(**{**vars(layer), "_k_scale": torch.ones(KV_HEADS)})  # per-head fp8 scales
    marked.forward(per_head, query, None, None, kv, metadata, output)
    odd_heads = torch.zeros(4, Q_HEADS, 24, dtype=torch.bfloat16, device=DEVICE)  # a head size the kernel does not take
    odd_cache = torch.zeros(kv.shape[:-1] + (24,), dtype=torch.bfloat16, device=DEVICE)
    marked.forward(layer, odd_heads, None, None, odd_cache, metadata, output)
    plain = _impl(impl_class, monkeypatch, None)
    assert not hasattr(plain, decode_attention.MARK)
    plain.forward(layer, query, None, None, kv, metadata, output)
    assert FlashAttentionImpl.calls == ["flash"] * (6 + len(options) + 3)


def test_every_launch_is_cut_for_the_engines_longest_context_not_the_batchs(impl_class, monkeypatch):
    impl = _impl(impl_class, monkeypatch, 4096)
    layer, query, kv, metadata, output = _batch(False)
    seen = []
    monkeypatch.setattr(decode_attention, "paged_decode_attention",
                        lambda *args, **kwargs: seen.append((kwargs["max_seq_len"], kwargs.get("config"))))
    impl.forward(layer, query, None, None, kv, metadata, output)
    assert seen == [(4096, None)]  # not the batch's 40 tokens: the kernel's default cut for the batch size


def test_the_request_is_an_engine_argument_vllm_hashes_and_install_is_undone_by_unpatch(monkeypatch):
    assert decode_attention.engine_arguments() == {
        "additional_config": {decode_attention.ENGINE_KEY: decode_attention.PAGED_TRITON}}
    assert decode_attention.requested_max_len(_engine_config(2112)) == 2112
    assert decode_attention.requested_max_len(_engine_config(None)) is None
    assert decode_attention.requested_max_len(types.SimpleNamespace(additional_config=None)) is None
    for mode, served in (("FULL_AND_PIECEWISE", True), ("FULL_DECODE_ONLY", True), ("PIECEWISE", True),
                         ("FULL", False)):
        config = _engine_config(2112)
        config.compilation_config = types.SimpleNamespace(cudagraph_mode=types.SimpleNamespace(name=mode))
        decode_attention._warn_once.cache_clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert decode_attention.requested_max_len(config) == (2112 if served else None), mode
        assert any("cudagraph_mode FULL" in str(w.message) for w in caught) == (not served), mode
    import trl_turbo
    from trl_turbo import registry

    cls = type("Impl", (FlashAttentionImpl,), {"__init__": FlashAttentionImpl.__init__,
                                                "forward": FlashAttentionImpl.forward})
    monkeypatch.setattr(decode_attention, "_flash_attention_impl", lambda: cls)
    original_init, original_forward = cls.__dict__["__init__"], cls.__dict__["forward"]
    try:
        decode_attention.install()
        routed = cls.__dict__["forward"]
        assert routed is not original_forward and routed.__wrapped__ is original_forward
        decode_attention.install()  # once
        assert cls.__dict__["forward"] is routed
    finally:
        for name in ("__init__", "forward"):
            registry.restore_attr(cls, name)
    assert cls.__dict__["__init__"] is original_init and cls.__dict__["forward"] is original_forward
    assert callable(trl_turbo.unpatch)
