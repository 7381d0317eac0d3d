"""``python -m trl_turbo.bench engine-options``: which of vLLM's own kernels decode fastest at GRPO's batch sizes and
contexts, each against its decode step's byte floor, and whether it samples what vLLM's default kernels sample.

Design decision: before trl_turbo builds its sampling engine differently (another fp8 GEMM, another attention
backend), each candidate is measured alone: one vLLM engine per option, in a child process of its own (vLLM reads
some kernel choices from the environment at import), on the same random-init checkpoint, with nothing of trl_turbo
in the way. Each (batch, context) cell times the last half of one generation's decode steps (the whole generation
less one of half its length, `decode_profile.measure`, which also splits them by kernel class) and sets them against
the same steps' floor (`planning.roofline`: the weights in the option's dtype plus the live KV cache, at the read
bandwidth measured once per command). Each option also samples greedily on a fixed prompt set, so the driver
reports how many tokens agree with its reference option's (the default kernels of the same precision), and how far
apart the log-probs of the chosen tokens are up to each sequence's first divergence.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..planning.roofline import Generation, decode_bytes
from ..vllm import engine_request
from . import engine_requests
from .decode_profile import format_profile, measure, probe_prompts, short_tokens
from .gpu_children import child_main, run_jobs, save_row
from .results import DEFAULT_RESULTS_DIR
from .roofline import shape_spec


@dataclass(frozen=True)
class EngineOption:
    """vLLM engine arguments and environment of one candidate; `reference`: the option whose greedy samples it must
    reproduce (None: it is a reference, vLLM's default kernels for its precision)."""

    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    reference: str | None = None
    # trl_turbo's candidate kernels the engine asks for (`engine_requests.REQUESTS`): the weight-only fp8 GEMM for
    # decode-sized batches, the paged attention for decode steps
    requests: tuple[str, ...] = ()
    sampling: dict[str, Any] = field(default_factory=dict)  # `SamplingParams` fields over TRL's (host-side work)

    @property
    def weight_dtype(self) -> str:
        return "fp8" if self.engine_kwargs.get("quantization") == "fp8" else "bf16"

    @property
    def kv_bytes(self) -> int:
        return 1 if str(self.engine_kwargs.get("kv_cache_dtype", "auto")).startswith("fp8") else 2


FP8 = {"quantization": "fp8", "kv_cache_dtype": "fp8"}  # trl_turbo's "fp8" sampling with an fp8 KV cache
OPTIONS: dict[str, EngineOption] = {
    "bf16": EngineOption(),
    "bf16-triton-attention": EngineOption({"attention_backend": "TRITON_ATTN"}, reference="bf16"),
    "fp8": EngineOption(FP8),  # CUTLASS W8A8: activations quantized per token at every linear layer
    "fp8-bf16-kv": EngineOption({"quantization": "fp8"}, reference="fp8"),
    # Triton's unified attention widens each fp8 KV tile to 16 bits in registers; FA3 runs fp8 x fp8 products
    "fp8-triton-attention": EngineOption({**FP8, "attention_backend": "TRITON_ATTN"}, reference="fp8"),
    # Marlin: weight-only fp8, activations stay 16-bit; vLLM takes it on Hopper only when told to
    "fp8-marlin": EngineOption(FP8, {"VLLM_TEST_FORCE_FP8_MARLIN": "1"}, reference="fp8"),
    "fp8-torch": EngineOption({**FP8, "linear_backend": "torch"}, reference="fp8"),
    # KV pages of 64 tokens instead of vLLM's 16: fewer, longer contiguous reads per page-table entry in attention
    "bf16-block-64": EngineOption({"block_size": 64}, reference="bf16"),
    "fp8-block-64": EngineOption({**FP8, "block_size": 64}, reference="fp8"),
    # the host's share of a step: no text for the tokens and their log-probs, which TRL never reads; log-probs in
    # flat lists instead of a dict and an object per token (fewer objects for the garbage collector to walk)
    "fp8-no-text": EngineOption(FP8, reference="fp8", sampling={"detokenize": False}),
    "fp8-no-text-flat": EngineOption(FP8, reference="fp8", sampling={"detokenize": False, "flat_logprobs": True}),
    "fp8-turbo-gemm": EngineOption(FP8, reference="fp8", requests=("fp8-gemm",)),
    # decode steps through trl_turbo's paged attention kernel: no fixed cost per launch for short contexts
    "bf16-turbo-attention": EngineOption(reference="bf16", requests=("decode-attention",)),
    "fp8-turbo-attention": EngineOption(FP8, reference="fp8", requests=("decode-attention",)),
}
GREEDY_PROMPTS = 8
GREEDY_TOKENS = 64
# A real model's greedy prompts (`--model`): text, so that its logits are as peaked as in use and two kernels whose
# sums round differently pick the same tokens unless the difference is more than rounding
GREEDY_TEXTS = (
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):\n    ",
    "Photosynthesis is the process by which",
    "Question: what is 17 + 25? Answer:",
    "The three primary colors are",
    "In 1969, the first humans to walk on the Moon",
    "A haiku about autumn:\n",
)


def greedy_prompts(real_weights: bool) -> list[Any]:
    """The fixed prompts of the greedy agreement check: text for a real model, token ids for a random-init one."""
    return list(GREEDY_TEXTS) if real_weights else probe_prompts(GREEDY_PROMPTS, 16)


def step_floor_s(spec: Any, option: EngineOption, batch: int, context: int, tokens: int,
                 read_bytes_per_s: float) -> float:
    """The floor of one of the decode steps `decode_profile.measure` times in a `tokens`-token generation after
    prompts of `context` tokens, `batch` sequences: the bytes the whole generation's decode steps read
    (`planning.roofline`) less the shorter generation's, over the steps between."""
    def read(completion_len: int) -> float:
        return decode_bytes(spec, Generation(sequences=batch, prompt_len=context, completion_len=completion_len,
                                             weight_dtype=option.weight_dtype, kv_bytes=option.kv_bytes))

    short = short_tokens(tokens)
    return (read(tokens) - read(short)) / max(1, tokens - short) / read_bytes_per_s


def chosen(completion: Any) -> dict[str, Any]:
    """A vLLM completion's tokens and each one's log-prob."""
    tokens = list(completion.token_ids)
    return {"tokens": tokens, "logprobs": [step[token].logprob for token, step in zip(tokens, completion.logprobs)]}


def agreement(samples: list[dict[str, Any]], reference: list[dict[str, Any]]) -> dict[str, Any]:
    """Greedy agreement of `samples` with `reference` (each {"tokens", "logprobs"} per prompt): tokens equal at the
    same position, each sequence's first divergence, and the largest log-prob difference of the chosen tokens
    before it (the same tokens in the same context, so any difference is the kernels' rounding)."""
    same = total = 0
    first, gap = [], 0.0
    for ours, theirs in zip(samples, reference, strict=True):
        pairs = list(zip(ours["tokens"], theirs["tokens"]))
        same += sum(a == b for a, b in pairs)
        total += len(pairs)
        divergence = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
        first.append(divergence)
        for a, b in zip(ours["logprobs"][:divergence], theirs["logprobs"][:divergence]):
            gap = max(gap, abs(a - b))
    return {"tokens_equal": same, "tokens": total, "first_divergence": first, "max_logprob_gap_before_divergence": gap}


# ------------------------------------------------------------------------------------------------ the driver
def run(args: argparse.Namespace) -> Path:
    import json

    import torch

    from .e2e import prepare_checkpoint
    from .hardware import measure_apart as measure_hardware
    from .results import metadata

    names = [name.strip() for name in args.options.split(",") if name.strip()]
    unknown = sorted(set(names) - set(OPTIONS))
    if unknown:
        raise SystemExit(f"unknown options {unknown}; choose from {sorted(OPTIONS)}")
    for name in names:
        reference = OPTIONS[name].reference
        if reference is not None and reference not in names:
            raise SystemExit(f"option {name!r} is checked against {reference!r}: list that option too")
    if not torch.cuda.is_available():
        raise SystemExit("the engine-options benchmark runs vLLM: it needs a CUDA GPU")
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    max_model_len = max(contexts) + args.tokens
    checkpoint = Path(args.model or args.checkpoint)
    if args.model is None:
        prepare_checkpoint(args.shape, checkpoint, 0, "cuda")
    device = torch.device("cuda", 0)
    hardware = measure_hardware(device)
    torch.cuda.empty_cache()
    config = {"shape": args.shape, "model": args.model, "options": {name: OPTIONS[name].__dict__ for name in names},
              "batches": batches, "contexts": contexts, "tokens": args.tokens, "max_model_len": max_model_len,
              "gpu_memory_utilization": args.gpu_memory_utilization,
              "greedy_prompts": greedy_prompts(args.model is not None),
              "greedy_tokens": GREEDY_TOKENS}
    meta = {**metadata("engine-options", device, config), "hardware": hardware}
    common = {"checkpoint": str(checkpoint), "batches": batches, "contexts": contexts, "tokens": args.tokens,
              "max_model_len": max_model_len, "gpu_memory_utilization": args.gpu_memory_utilization,
              "real_weights": args.model is not None}
    spec = shape_spec(args.shape, None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"engine-options-{args.shape}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    rows: list[dict[str, Any]] = []
    for name in names:  # one engine after another, the file rewritten after each: a cut-short command keeps its rows
        row = run_jobs("trl_turbo.bench.engine_options", [{**common, "name": name, "option": name}], ["0"],
                       args.job_timeout)[0]
        row["name"] = name  # a job that never ran has no name of its own
        rows.append(row)
        finish_rows(rows, spec, args.tokens, hardware["read_bytes_per_s"])
        path.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    for row in rows:
        print(format_row(row), flush=True)
    print(f"wrote {path}")
    return path


def finish_rows(rows: list[dict[str, Any]], spec: Any, tokens: int, read_bytes_per_s: float) -> None:
    """Each measured cell against its floor, and each option's greedy agreement with its reference where both ran."""
    by_name = {row["name"]: row for row in rows}
    for row in rows:
        option = OPTIONS[row["name"]]
        for cell in row.get("cells", []):
            cell["floor_ms"] = 1e3 * step_floor_s(spec, option, cell["batch"], cell["context"], tokens,
                                                  read_bytes_per_s)
            cell["over_floor"] = cell["ms_per_step"] / cell["floor_ms"]
        reference = by_name.get(option.reference) if option.reference else None
        if reference and row.get("greedy") and reference.get("greedy"):
            row["agreement"] = agreement(row["greedy"], reference["greedy"])


def format_row(row: dict[str, Any]) -> str:
    if not row.get("ok"):
        return f"{row['name']}: FAILED {str(row.get('error'))[-400:]}"
    cells = "; ".join(f"{c['batch']}x@{c['context']} {c['ms_per_step']:.2f} ms ({c.get('over_floor', 0):.2f}x floor)"
                      for c in row["cells"])
    agreed = row.get("agreement")
    agreed_text = "" if agreed is None else f"; greedy {agreed['tokens_equal']}/{agreed['tokens']} tokens agree"
    return f"{row['name']}: {cells}{agreed_text}"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("engine-options", help="vLLM's decode kernels at GRPO batch sizes against "
                                                          "their byte floor, one engine per option")
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--options", default=",".join(OPTIONS), help=f"comma-separated, among {','.join(OPTIONS)}")
    parser.add_argument("--batches", default="8,64", help="sequences per decode step")
    parser.add_argument("--contexts", default="16,1984", help="prompt lengths: the context the decode steps run at")
    parser.add_argument("--tokens", type=int, default=128, help="tokens each measured generation samples")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    parser.add_argument("--checkpoint", default="/tmp/trl-turbo-llama-3.1-8b", help="random-init checkpoint (reused)")
    parser.add_argument("--model", default=None,
                        help="a local checkpoint of the shape's architecture (real weights), used as it is")
    parser.add_argument("--job-timeout", type=float, default=300.0)
    parser.add_argument("--out", default=str(DEFAULT_RESULTS_DIR), help="results folder")
    parser.set_defaults(func=run)


# ------------------------------------------------------------------------------------------------ the child
def run_job(spec: dict[str, Any], row: dict[str, Any]) -> None:
    """One option's engine: greedy samples, then each (batch, context) cell's decode steps; `row` filled in place."""
    option = OPTIONS[spec["option"]]
    # before vLLM is imported: it reads these when it picks kernels. In-process, as TRL's colocated engine runs
    # (and so that the profiler sees the engine's kernels)
    os.environ.update({**option.env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    from vllm import LLM, SamplingParams

    engine_kwargs = engine_request.combined(option.engine_kwargs, *engine_requests.installed(option.requests))

    start = time.perf_counter()
    llm = LLM(model=spec["checkpoint"], dtype="bfloat16", max_model_len=spec["max_model_len"],
              max_num_seqs=max(spec["batches"]), gpu_memory_utilization=spec["gpu_memory_utilization"],
              enable_prefix_caching=False, logprobs_mode="processed_logprobs", seed=0, **engine_kwargs)
    row["init_s"] = time.perf_counter() - start
    greedy = SamplingParams(**{"max_tokens": GREEDY_TOKENS, "temperature": 0.0, "ignore_eos": True, "logprobs": 0,
                               **option.sampling})
    outputs = llm.generate(greedy_prompts(spec.get("real_weights", False)), greedy, use_tqdm=False)
    row["greedy"] = [chosen(output.outputs[0]) for output in outputs]
    row.update(ok=True, cells=[])
    for context in spec["contexts"]:
        for batch in spec["batches"]:
            summary = measure(llm, probe_prompts(batch, context), spec["tokens"], sampling=option.sampling)
            row["cells"].append({"batch": batch, "context": context, **summary})
            save_row(spec, row)  # a timeout keeps the cells measured so far
            print(f"{spec['option']}, context {context}: " + format_profile(batch, summary), flush=True)


if __name__ == "__main__":
    child_main(run_job)
