"""``python -m trl_turbo.bench loss``: the LM-head + GRPO (DAPO) loss stage alone, for several implementations.

Design decision: this isolates the one stage whose memory grows with ``tokens × vocab`` — hidden states ``[N, H]``
in, frozen head ``[V, H]`` (the LoRA case), per-token log-probs, DAPO token-level loss on-policy
(``old = logp.detach()``), backward to the hidden states — so the implementations are compared on equal inputs
without a model around them. Reported memory is the extra allocation during forward+backward over what the inputs
already hold, both raw and minus the ``N·H`` gradient of the hidden states that every implementation must return.
``trl`` is TRL's own ``ChunkedLogProbFunction`` taken from ``trl.kernels.chunked_logprob`` (never through
``trl.trainer.utils``, which trl_turbo patches); ``liger`` is liger-kernel's fused linear GRPO loss; ``turbo`` is
``trl_turbo.ops.fused_logprobs``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..planning.shapes import LOSS_PRESETS
from . import (
    fmt,
    free_memory,
    memory_allocated,
    parse_lengths,
    peak_allocated,
    reset_peak,
    resolve_device,
    synchronize,
)
from .results import DEFAULT_RESULTS_DIR, GIB, metadata, write

IMPLS = ("trl", "liger", "turbo")
EPSILON = 0.2  # GRPOConfig's default epsilon (epsilon_high defaults to it)
_TRL_CHUNK_SIZE = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# (hidden [N, H], weight [V, H], targets [N], advantages [B], micro_batch) -> scalar loss
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def dapo_loss(logp: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """TRL 1.16's DAPO loss on ``[B, T]`` log-probs, on-policy, no padding: token sum over ``num_items_in_batch``."""
    coef_1 = torch.exp(logp - logp.detach())
    coef_2 = torch.clamp(coef_1, 1 - EPSILON, 1 + EPSILON)
    adv = advantages.unsqueeze(1)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    return per_token_loss.sum() / logp.numel()


def _trl_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, advantages: torch.Tensor,
              micro_batch: int) -> torch.Tensor:
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    if not ChunkedLogProbFunction.__module__.startswith("trl."):
        raise RuntimeError(f"trl.kernels.chunked_logprob.ChunkedLogProbFunction is patched ({ChunkedLogProbFunction})")
    # Same call as TRL's fused LM head: entropy is computed (for the metric) but gets no gradient
    logp, _entropy, *_ = ChunkedLogProbFunction.apply(
        hidden, weight, None, targets, 1.0, _TRL_CHUNK_SIZE, None, 1.0, ("log_probs", "entropy")
    )
    return dapo_loss(logp.view(micro_batch, -1), advantages)


def _turbo_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, advantages: torch.Tensor,
                micro_batch: int) -> torch.Tensor:
    from trl_turbo.ops import fused_logprobs

    logp, _entropy = fused_logprobs(hidden, weight, targets, compute_entropy=True, entropy_grad=False)
    return dapo_loss(logp.view(micro_batch, -1), advantages)


def _liger_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, advantages: torch.Tensor,
                micro_batch: int) -> torch.Tensor:
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    # Liger folds the loss into its forward (gradients are computed there, per sequence chunk); its loss math is
    # torch.compile'd on GPU as in its default configuration, eager on CPU.
    loss_fn = LigerFusedLinearGRPOLoss(
        beta=0.0,
        use_ref_model=False,
        loss_type="dapo",
        epsilon_low=EPSILON,
        epsilon_high=EPSILON,
        compiled=hidden.device.type == "cuda",
    )
    tokens = targets.numel()
    loss, _metrics = loss_fn(
        hidden.view(micro_batch, tokens // micro_batch, -1),
        weight,
        targets.view(micro_batch, -1),
        torch.ones(micro_batch, tokens // micro_batch, device=hidden.device, dtype=torch.long),
        advantages,
        num_items_in_batch=torch.tensor(tokens, device=hidden.device),
    )
    return loss


LOSS_FNS: dict[str, LossFn] = {"trl": _trl_loss, "liger": _liger_loss, "turbo": _turbo_loss}


def make_inputs(hidden_size: int, vocab: int, micro_batch: int, completion_len: int, dtype: torch.dtype,
                device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random inputs drawn on the device itself (host-side draws of a [N, H] tensor take seconds per length)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    tokens = micro_batch * completion_len
    return {
        "hidden": torch.randn(tokens, hidden_size, generator=gen, device=device, dtype=dtype).requires_grad_(),
        "weight": torch.randn(vocab, hidden_size, generator=gen, device=device, dtype=dtype).mul_(0.02),
        "targets": torch.randint(vocab, (tokens,), generator=gen, device=device),
        "advantages": torch.randn(micro_batch, generator=gen, device=device),
    }


def fwd_bwd(loss_fn: LossFn, inputs: dict[str, torch.Tensor], micro_batch: int) -> None:
    inputs["hidden"].grad = None
    loss = loss_fn(inputs["hidden"], inputs["weight"], inputs["targets"], inputs["advantages"], micro_batch)
    loss.backward()


def _time_ms(loss_fn: LossFn, inputs: dict[str, torch.Tensor], micro_batch: int, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fwd_bwd(loss_fn, inputs, micro_batch)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    begin = time.perf_counter()
    fwd_bwd(loss_fn, inputs, micro_batch)
    return (time.perf_counter() - begin) * 1000


def measure(loss_fn: LossFn, inputs: dict[str, torch.Tensor], micro_batch: int, device: torch.device,
            repeats: int) -> dict[str, float | None]:
    """Warm up, measure the peak of one fwd+bwd from a clean state (no stale gradient), then time ``repeats`` runs."""
    fwd_bwd(loss_fn, inputs, micro_batch)
    inputs["hidden"].grad = None
    synchronize(device)
    before = memory_allocated(device)
    reset_peak(device)
    fwd_bwd(loss_fn, inputs, micro_batch)
    synchronize(device)
    peak = peak_allocated(device)
    times = [_time_ms(loss_fn, inputs, micro_batch, device) for _ in range(repeats)]
    inputs["hidden"].grad = None
    if peak is None or before is None:
        extra = beyond_grad = None
    else:
        hidden = inputs["hidden"]
        extra = (peak - before) / GIB
        beyond_grad = (peak - before - hidden.numel() * hidden.element_size()) / GIB
    return {"peak_extra_gib": extra, "peak_extra_beyond_grad_gib": beyond_grad, "fwd_bwd_ms": statistics.median(times)}


def run(args: argparse.Namespace) -> Path:
    device = resolve_device(args.device)
    dtype = _DTYPES[args.dtype]
    lengths = parse_lengths(args.lengths)
    impls = [impl.strip() for impl in args.impls.split(",") if impl.strip()]
    unknown = set(impls) - set(IMPLS)
    if unknown:
        raise SystemExit(f"unknown impls {sorted(unknown)}; choose from {IMPLS}")
    heads = LOSS_PRESETS[args.preset] if args.preset else [(args.hidden, args.vocab)]
    shape = args.preset or f"h{args.hidden}-v{args.vocab}"
    config = {
        "shape": shape,
        "heads": heads,
        "micro_batch": args.micro_batch,
        "lengths": lengths,
        "impls": impls,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "loss_type": "dapo",
        "epsilon": EPSILON,
        "device": str(device),
    }
    meta = metadata("loss", device, config)
    rows: list[dict[str, Any]] = []
    for hidden_size, vocab in heads:
        failed: set[str] = set()  # impls that failed (OOM or error) skip every longer length
        for completion_len in lengths:
            inputs = make_inputs(hidden_size, vocab, args.micro_batch, completion_len, dtype, device)
            for impl in impls:
                if impl in failed:
                    continue
                row: dict[str, Any] = {
                    "impl": impl,
                    "hidden": hidden_size,
                    "vocab": vocab,
                    "micro_batch": args.micro_batch,
                    "completion_len": completion_len,
                    "tokens": args.micro_batch * completion_len,
                    "ok": False,
                    "error": None,
                    "peak_extra_gib": None,
                    "peak_extra_beyond_grad_gib": None,
                    "fwd_bwd_ms": None,
                }
                try:
                    row.update(measure(LOSS_FNS[impl], inputs, args.micro_batch, device, args.repeats))
                    row["ok"] = True
                except torch.OutOfMemoryError:
                    row["error"] = "OOM"
                except Exception as exc:  # e.g. an impl missing here; recorded, the other impls still run
                    traceback.print_exc()
                    row["error"] = f"{type(exc).__name__}: {exc}"
                inputs["hidden"].grad = None
                rows.append(row)
                print(_format_row(row), flush=True)
                if not row["ok"]:
                    failed.add(impl)
                    free_memory(device)  # what the failed attempt left behind
            del inputs
    path = write(meta, rows, shape, Path(args.out), series=_series,
                 panels=(("peak_extra_gib", "peak extra memory (GiB)"), ("fwd_bwd_ms", "fwd+bwd time (ms)")))
    print(f"wrote {path} (+ .png)")
    return path


def _series(row: dict[str, Any]) -> str:
    return f"{row['impl']} H={row['hidden']} V={row['vocab']}"


def _format_row(row: dict[str, Any]) -> str:
    status = "ok" if row["ok"] else row["error"]
    return (
        f"{row['impl']:>5} H={row['hidden']} V={row['vocab']} B={row['micro_batch']} L={row['completion_len']:>6} "
        f"{status}  extra={fmt(row['peak_extra_gib'], '6.2f')} GiB  "
        f"beyond grad={fmt(row['peak_extra_beyond_grad_gib'], '6.2f')} GiB  "
        f"fwd+bwd={fmt(row['fwd_bwd_ms'], '8.1f')} ms"
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("loss", help="LM head + DAPO loss fwd+bwd alone, per implementation")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--preset", choices=sorted(LOSS_PRESETS), default=None,
                        help="run several (hidden, vocab) heads together; overrides --hidden/--vocab")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--lengths", default="2048,8192,20480", help="comma-separated completion lengths")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, among {','.join(IMPLS)}")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs after the warm-up (median reported)")
    parser.add_argument("--out", default=str(DEFAULT_RESULTS_DIR), help="results folder")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.set_defaults(func=run)
