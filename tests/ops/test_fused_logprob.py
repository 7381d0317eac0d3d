"""Tests for `trl_turbo.ops.fused_logprob`: both per-tile backends (Triton kernels run under TRITON_INTERPRET=1 on CPU)
against an fp64 reference. Low-precision tolerance follows flash-attention: the error of the op against the fp64
reference may be at most twice that of the naive low-precision computation (+ a tiny floor)."""

import importlib.util

import pytest
import torch

from trl_turbo.ops import fused_logprobs, reference_logprobs
from trl_turbo.ops.fused_logprob import _force_backend, _triton_usable
from trl_turbo.testing.tolerance import assert_within_naive_error, max_error

# conftest.py sets TRITON_INTERPRET=1 on machines without CUDA before Triton is first imported


_TRITON_ON_CPU = _triton_usable(torch.device("cpu"))
BACKENDS = [
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("triton") is None or torch.cuda.is_available(),
            reason="Triton not installed (a GPU machine runs these kernels natively in the GPU tests)",
        ),
    ),
]


def test_triton_kernels_run_interpreted_on_cpu():
    """Where Triton is installed and there is no GPU, the CPU suite must exercise the kernels, not skip them."""
    if importlib.util.find_spec("triton") is None or torch.cuda.is_available():
        pytest.skip("Triton not installed, or a GPU machine")
    assert _TRITON_ON_CPU, "Triton is installed but the kernels are not interpreted: TRITON_INTERPRET=1 came too late"
N, H, V = 40, 32, 1000  # V is not a multiple of the 1024-wide kernel blocks: ragged last block
CHUNK = 16  # 3 token chunks, the last one partial
CONFIGS = {
    "plain": {"temperature": 1.0, "logit_scale": 1.0, "softcap": None},
    "temp_scale": {"temperature": 0.7, "logit_scale": 1.3, "softcap": None},
    "softcap": {"temperature": 0.9, "logit_scale": 0.8, "softcap": 6.0},
}


def _inputs(dtype, n=N, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = (2 * torch.randn(n, H, generator=gen)).to(dtype)
    weight = (torch.randn(V, H, generator=gen) / H**0.5).to(dtype)
    b = (0.5 * torch.randn(V, generator=gen)).to(dtype) if bias else None
    targets = torch.randint(0, V, (n,), generator=gen)
    g_lp = torch.randn(n, generator=gen)
    g_ent = torch.randn(n, generator=gen)
    return hidden, weight, b, targets, g_lp, g_ent


def _run(fn, hidden, weight, bias, targets, g_lp, g_ent, train_weight=False, **kwargs):
    """Outputs and the gradients of `sum(g_lp * logp + g_ent * entropy)` (g_ent=None: logp only)."""
    hidden = hidden.detach().requires_grad_(True)
    weight = weight.detach().requires_grad_(train_weight)
    bias = bias.detach().requires_grad_(train_weight) if bias is not None else None
    logp, entropy = fn(hidden, weight, targets, bias=bias, compute_entropy=g_ent is not None, **kwargs)
    loss = (g_lp * logp).sum()
    if g_ent is not None:
        loss = loss + (g_ent * entropy).sum()
    loss.backward()
    grads = [hidden.grad] + ([weight.grad] + ([bias.grad] if bias is not None else []) if train_weight else [])
    return [x.detach() for x in [logp, entropy] if x is not None] + grads


def _check(dtype, fused, naive, ref):
    for index, (out, low, exact) in enumerate(zip(fused, naive, ref, strict=True)):
        if dtype == torch.float32:
            assert max_error(out, exact) <= 1e-5 * max(1.0, exact.abs().max().item()), (index, max_error(out, exact))
        else:
            assert_within_naive_error(out, low, exact, what=f"output {index}")


def _compare(backend, dtype, *, bias=False, train_weight=False, with_entropy=True, **kwargs):
    hidden, weight, b, targets, g_lp, g_ent = _inputs(dtype, bias=bias)
    g_ent = g_ent if with_entropy else None
    with _force_backend(backend):
        fused = _run(
            fused_logprobs, hidden, weight, b, targets, g_lp, g_ent, train_weight, chunk_tokens=CHUNK, **kwargs
        )
    naive = _run(reference_logprobs, hidden, weight, b, targets, g_lp, g_ent, train_weight, **kwargs)
    up = [x.double() if x is not None else None for x in (hidden, weight, b)]
    ref = _run(reference_logprobs, up[0], up[1], up[2], targets, g_lp.double(), g_ent, train_weight, **kwargs)
    n_out = 2 if with_entropy else 1
    assert fused[0].shape == targets.shape and all(x.dtype == torch.float32 for x in fused[:n_out])
    # Gradients come back in the dtypes of the inputs they belong to
    assert [g.dtype for g in fused[n_out:]] == [g.dtype for g in naive[n_out:]]
    _check(dtype, fused, naive, ref)
    return fused


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_basis_path_values_and_hidden_grad(backend, dtype, config):
    # Entropy with a gradient for the non-trivial configs, logp only for "plain"
    _compare(backend, dtype, with_entropy=config != "plain", **CONFIGS[config])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_recompute_path_weight_and_bias_grad(backend, dtype):
    _compare(backend, dtype, bias=True, train_weight=True, **CONFIGS["softcap"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_recompute_path_logp_only(backend):
    _compare(backend, torch.float32, train_weight=True, with_entropy=False, **CONFIGS["temp_scale"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_entropy_only_gradient(backend):
    hidden, weight, _, targets, _, g_ent = _inputs(torch.float32)
    outs = []
    for fn, ctx in ((fused_logprobs, _force_backend(backend)), (reference_logprobs, torch.enable_grad())):
        h = hidden.clone().requires_grad_(True)
        with ctx:
            kwargs = {"chunk_tokens": CHUNK} if fn is fused_logprobs else {}
            _, entropy = fn(h, weight, targets, compute_entropy=True, **CONFIGS["softcap"], **kwargs)
        (g_ent * entropy).sum().backward()
        outs.append(h.grad)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_entropy_grad_false(backend):
    hidden, weight, _, targets, g_lp, _ = _inputs(torch.float32)
    h = hidden.clone().requires_grad_(True)
    with _force_backend(backend):
        logp, entropy = fused_logprobs(
            h, weight, targets, compute_entropy=True, entropy_grad=False, chunk_tokens=CHUNK, **CONFIGS["temp_scale"]
        )
    ref_h = hidden.clone().requires_grad_(True)
    ref_logp, ref_entropy = reference_logprobs(ref_h, weight, targets, compute_entropy=True, **CONFIGS["temp_scale"])
    torch.testing.assert_close(entropy.detach(), ref_entropy.detach(), atol=1e-5, rtol=1e-5)
    (g_lp * logp).sum().backward(retain_graph=True)
    (g_lp * ref_logp).sum().backward()
    torch.testing.assert_close(h.grad, ref_h.grad, atol=1e-5, rtol=1e-5)

    h2 = hidden.clone().requires_grad_(True)
    _, entropy = fused_logprobs(h2, weight, targets, compute_entropy=True, entropy_grad=False, chunk_tokens=CHUNK)
    with pytest.raises(RuntimeError, match="entropy_grad=False"):
        entropy.sum().backward()


def test_entropy_grad_true_needs_entropy():
    hidden, weight, _, targets, _, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="compute_entropy"):
        fused_logprobs(hidden, weight, targets, entropy_grad=True)


def test_retain_graph_guard():
    hidden, weight, _, targets, _, _ = _inputs(torch.float32)
    h = hidden.clone().requires_grad_(True)
    logp, _ = fused_logprobs(h, weight, targets, chunk_tokens=CHUNK)
    logp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        logp.sum().backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_grad_path(backend):
    hidden, weight, b, targets, _, _ = _inputs(torch.bfloat16, bias=True)
    ref_logp, ref_entropy = reference_logprobs(
        hidden.double(), weight.double(), targets, bias=b.double(), compute_entropy=True, **CONFIGS["softcap"]
    )
    naive_logp, naive_entropy = reference_logprobs(hidden, weight, targets, bias=b, compute_entropy=True,
                                                   **CONFIGS["softcap"])
    with _force_backend(backend), torch.no_grad():
        logp, entropy = fused_logprobs(
            hidden.requires_grad_(True), weight, targets, bias=b, compute_entropy=True, chunk_tokens=CHUNK,
            **CONFIGS["softcap"],
        )
    assert logp.grad_fn is None and entropy.grad_fn is None
    assert_within_naive_error(logp, naive_logp, ref_logp, what="logp")
    assert_within_naive_error(entropy, naive_entropy, ref_entropy, what="entropy")
    # Nothing requires grad (grad mode on): statistics only as well
    with _force_backend(backend):
        logp2, _ = fused_logprobs(hidden.detach(), weight, targets, bias=b, chunk_tokens=CHUNK, **CONFIGS["softcap"])
    assert logp2.grad_fn is None
    torch.testing.assert_close(logp2, logp, atol=0, rtol=0)


def test_leading_dims_and_default_chunk():
    hidden, weight, _, targets, _, _ = _inputs(torch.float32)
    h = hidden.view(4, 10, H).clone().requires_grad_(True)
    logp, entropy = fused_logprobs(h, weight, targets.view(4, 10), compute_entropy=True)
    ref_h = hidden.clone().requires_grad_(True)
    ref_logp, ref_entropy = reference_logprobs(ref_h, weight, targets, compute_entropy=True)
    assert logp.shape == entropy.shape == (4, 10)
    torch.testing.assert_close(logp.view(-1), ref_logp.detach())
    torch.testing.assert_close(entropy.view(-1), ref_entropy.detach())
    (logp.sum() + entropy.sum()).backward()
    (ref_logp.sum() + ref_entropy.sum()).backward()
    assert h.grad.shape == h.shape
    torch.testing.assert_close(h.grad.view(-1, H), ref_h.grad, atol=1e-5, rtol=1e-5)


def test_autocast_compute_dtype():
    hidden, weight, _, targets, g_lp, _ = _inputs(torch.float32)
    outs = []
    for fn in (fused_logprobs, reference_logprobs, None):
        h = (hidden.double() if fn is None else hidden).clone().requires_grad_(True)
        if fn is None:  # exact: fp64, no autocast
            logp, _ = reference_logprobs(h, weight.double(), targets)
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logp, _ = fn(h, weight, targets)
            assert logp.dtype == torch.float32
        (g_lp.to(logp.dtype) * logp).sum().backward()
        outs.append((logp.detach(), h.grad))
    (fused_logp, fused_grad), (naive_logp, naive_grad), (exact_logp, exact_grad) = outs
    assert fused_grad.dtype == torch.float32
    assert_within_naive_error(fused_logp, naive_logp, exact_logp, what="logp")
    assert_within_naive_error(fused_grad, naive_grad, exact_grad, what="hidden grad")
    # Both projections ran in bf16 (an op ignoring autocast would compute in fp32, errors near fp32 rounding)
    for what, error in (("fused", max_error(fused_logp, exact_logp)), ("naive", max_error(naive_logp, exact_logp))):
        assert error > 1e-4, (what, error)


# --------------------------------------------------------------------------- GPU (real shapes, run by the lead)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gpu_inputs(n, hidden_size, vocab, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, hidden_size, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) * 2 / hidden_size**0.5).to(dtype)
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    g_lp = torch.randn(n, device="cuda", generator=gen)
    g_ent = torch.randn(n, device="cuda", generator=gen)
    return hidden, weight, targets, g_lp, g_ent


def _reference_by_rows(hidden, weight, targets, g_lp, g_ent, up, rows=2048, **kwargs):
    """Reference logp/entropy/grad_hidden, `rows` tokens at a time (tokens are independent), inputs cast by `up`."""
    outs = [[], [], []]
    w = up(weight)
    for s in range(0, hidden.shape[0], rows):
        h = up(hidden[s : s + rows]).requires_grad_(True)
        logp, entropy = reference_logprobs(h, w, targets[s : s + rows], compute_entropy=True, **kwargs)
        ((g_lp[s : s + rows] * logp).sum() + (g_ent[s : s + rows] * entropy).sum()).backward()
        for acc, x in zip(outs, (logp.detach(), entropy.detach(), h.grad), strict=True):
            acc.append(x)
    return [torch.cat(x) for x in outs]


@pytest.mark.parametrize("vocab,hidden_size,n", [(128256, 4096, 20000), (151936, 3584, 20000), (151936, 896, 4096)])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.gpu
@requires_cuda
def test_gpu_real_shapes(vocab, hidden_size, n, softcap, backend):
    if backend == "torch" and n > 4096:
        pytest.skip("torch tile backend checked on the small shape only")
    kwargs = {"temperature": 0.9, "logit_scale": 1.0, "softcap": softcap}
    hidden, weight, targets, g_lp, g_ent = _gpu_inputs(n, hidden_size, vocab, torch.bfloat16)
    h = hidden.clone().requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with _force_backend(backend):
        logp, entropy = fused_logprobs(h, weight, targets, compute_entropy=True, **kwargs)
        ((g_lp * logp).sum() + (g_ent * entropy).sum()).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    if backend == "triton":
        # Two [rows, V] tiles (~256 MiB each), the fp32 u/v basis, the bf16 gradient and small temporaries: far
        # below the [N, V] logits (the torch tile backend has fp32 temporaries of the tile's size on top)
        assert peak < 2**30 + 12 * n * hidden_size, peak / 2**30
    fused = [logp.detach(), entropy.detach(), h.grad]
    ref = _reference_by_rows(hidden, weight, targets, g_lp, g_ent, lambda x: x.float(), **kwargs)
    naive = _reference_by_rows(hidden, weight, targets, g_lp, g_ent, lambda x: x, **kwargs)
    _check(torch.bfloat16, fused, naive, ref)


@pytest.mark.gpu
@requires_cuda
def test_gpu_recompute_path():
    hidden, weight, targets, g_lp, g_ent = _gpu_inputs(4096, 1024, 151936, torch.bfloat16)
    fused = _run(fused_logprobs, hidden, weight, None, targets, g_lp, g_ent, True, temperature=0.9)
    naive = _run(reference_logprobs, hidden, weight, None, targets, g_lp, g_ent, True, temperature=0.9)
    ref = _run(reference_logprobs, hidden.float(), weight.float(), None, targets, g_lp, g_ent, True, temperature=0.9)
    _check(torch.bfloat16, fused, naive, ref)
