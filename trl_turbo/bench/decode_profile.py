"""Where a decode step's time goes: the colocated engine's GPU kernels, by class, per decode step.

Design decision: a profile of a whole GRPO generation would record millions of kernels. The probe instead runs, after
a variant's measured steps, one short generation per batch size through the same engine in the same sampling mode
(the adapter merged into the shared weights, written into the fp8 copy, or in vLLM's LoRA slots, as a training
generation has it; stock's engine woken and synced as TRL does): first to warm up (CUDA graphs of that batch), then
timed (the fastest of three), then under torch's profiler with CUDA activity only (kernel durations; kernels replayed
from CUDA graphs included). Each generation runs for its whole length and for half of it, each from an empty prefix
cache, and the decode steps are the difference (the second half's steps), in wall time and in each kernel's time, so
long prompts put the decode steps at a long context without counting their prefill. Half, not the first token:
vLLM's chunked prefill runs a long batch's prompts over several steps with the first sequences' decode rows mixed
in, and a one-token run's prefill steps are not the whole generation's (other GEMM shapes, attention over other
rows); two generations longer than the prefill steps share them exactly. TRL builds the engine for its own
batch (`max_num_seqs`: a rank's micro-batch x steps per generation x T), so a larger probe batch runs in waves of
that many sequences: a decode step is then one scheduler step of one wave, and the summary counts tokens x waves of
them. Kernels are classed by name (`KERNEL_CLASSES`, first match wins); what a timed step spends outside every kernel
is its gap (launch latency, synchronisation, host work between steps). Everything but `measure` and `probe` is pure
and tested on CPU.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

# Ordered: attention before GEMM (flash attention's split-KV kernels), GEMM before fp8 quantization (cutlass's
# scaled-mm kernels are GEMMs; `scaled_fp8_quant` is not).
KERNEL_CLASSES: tuple[tuple[str, str], ...] = (
    ("attention", r"flash|fmha|attn|attention|paged|reshape_and_cache"),
    ("gemm", r"gemm|gemv|cutlass|xmma|nvjet|cublas|splitk|matmul|_mm_|scaled_mm|wgmma"),
    ("fp8 quantization", r"quant|fp8"),
    ("norm", r"rms|layer_?norm|rsqrt"),
    ("activation", r"silu|gelu|act_and_mul|swiglu"),
    ("rotary", r"rotary|rope"),
    ("sampling", r"sampl|topk|top_k|softmax|argmax|gumbel|multinomial|logprob|exponential|argsort|sort"),
    ("memory", r"memcpy|memset|copy|cat_|index|gather|scatter|fill"),
)
OTHER = "other elementwise"
PROBE_TOKENS = 128  # tokens each profiled generation samples; its second half's decode steps are measured
PROBE_CONTEXT = 16  # its prompts' default length: short, so attention reads little
TOP = 4  # kernels listed per class, the longest first


def compiled_classes(classes: Sequence[tuple[str, str]]) -> tuple[tuple[str, re.Pattern[str]], ...]:
    """A table of (class, name pattern) ready for `classify`."""
    return tuple((name, re.compile(pattern, re.IGNORECASE)) for name, pattern in classes)


_PATTERNS = compiled_classes(KERNEL_CLASSES)


def classify(kernel: str, classes: Sequence[tuple[str, re.Pattern[str]]] = _PATTERNS) -> str:
    """The class of a kernel name: the first of `classes` (a decode step's by default) whose pattern it matches,
    else `OTHER`."""
    return next((name for name, pattern in classes if pattern.search(kernel)), OTHER)


def waves(batch: int, max_num_seqs: int | None) -> int:
    """The scheduler's rounds of at most `max_num_seqs` sequences that `batch` sequences take (1: no limit known)."""
    return -(-batch // max_num_seqs) if max_num_seqs else 1


def summarize(kernels: Iterable[tuple[str, float, int]], *, steps: int, wall_s: float) -> dict[str, Any]:
    """Per decode step: wall time, kernel time by class (ms, share of kernel time, launches, its longest kernels) and
    the gap outside kernels. `kernels`: (name, total µs, launches) over the profiled generation; `wall_s`: the same
    generation's time without the profiler."""
    classes: dict[str, dict[str, Any]] = {}
    for name, total_us, launches in kernels:
        entry = classes.setdefault(classify(name), {"us": 0.0, "launches": 0, "kernels": []})
        entry["us"] += total_us
        entry["launches"] += launches
        entry["kernels"].append((total_us, launches, name))
    kernel_us = sum(entry["us"] for entry in classes.values())
    per_step = max(1, steps)
    return {
        "steps": steps,
        "ms_per_step": 1e3 * wall_s / per_step,
        "kernel_ms_per_step": kernel_us / 1e3 / per_step,
        "gap_ms_per_step": max(0.0, 1e3 * wall_s - kernel_us / 1e3) / per_step,
        "classes": {name: {"ms_per_step": entry["us"] / 1e3 / per_step,
                           "share": entry["us"] / kernel_us if kernel_us else 0.0,
                           "launches_per_step": entry["launches"] / per_step,
                           "top_kernels": [{"name": name[:160], "ms_per_step": us / 1e3 / per_step,
                                            "launches_per_step": count / per_step}
                                           for us, count, name in sorted(entry["kernels"], reverse=True)[:TOP]]}
                    for name, entry in sorted(classes.items(), key=lambda item: -item[1]["us"])},
    }


def format_profile(batch: int, summary: dict[str, Any]) -> str:
    """One line per batch size: the step, its gap and its three largest classes."""
    top = ", ".join(f"{name} {entry['ms_per_step']:.2f} ms" for name, entry in list(summary["classes"].items())[:3])
    return (f"decode profile, {batch} sequences: {summary['ms_per_step']:.2f} ms/step (kernels "
            f"{summary['kernel_ms_per_step']:.2f}, gap {summary['gap_ms_per_step']:.2f}): {top}")


def kernel_totals(profiler: Any) -> list[tuple[str, float, int]]:
    """(name, total µs, launches) of every GPU kernel a torch profiler recorded."""
    totals = []
    for event in profiler.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0.0)
        if device_us and "cuda" in str(getattr(event, "device_type", "")).lower():
            totals.append((event.key, float(device_us), int(event.count)))
    return totals


def short_tokens(tokens: int) -> int:
    """The length of the shorter generation whose steps are subtracted: the measured steps are the last half."""
    return max(1, tokens // 2)


def prefill_steps(sequences: int, prompt_len: int, max_batched_tokens: int | None) -> int:
    """The scheduler steps a wave's prefill takes at most: its prompt tokens in chunks of the engine's token budget,
    each step's budget less one token for every sequence already decoding (at most all of them), and one more step
    (1: no budget known; refused: a budget no larger than the wave)."""
    if not max_batched_tokens:
        return 1
    if max_batched_tokens <= sequences:
        raise ValueError(f"a token budget of {max_batched_tokens} per step cannot prefill beside {sequences} "
                         "decoding sequences")
    return -(-sequences * prompt_len // (max_batched_tokens - sequences)) + 1


def decode_kernels(whole: Iterable[tuple[str, float, int]],
                   shorter: Iterable[tuple[str, float, int]]) -> list[tuple[str, float, int]]:
    """Each kernel's (name, µs, launches) over the decode steps one generation has beyond a shorter one of the same
    prompts (the prefill and the first steps, the same in both, cancel), kernels those steps never ran dropped."""
    first = {name: (us, launches) for name, us, launches in shorter}
    decode = []
    for name, us, launches in whole:
        shorter_us, shorter_launches = first.get(name, (0.0, 0))
        if launches > shorter_launches:
            decode.append((name, max(0.0, us - shorter_us), launches - shorter_launches))
    return decode


def uneven_kernels(decode: Iterable[tuple[str, float, int]], steps: int) -> dict[str, float]:
    """ms per step of the decode kernels whose launches are not a whole number per step. Every decode step launches
    the same kernels, so these are what the subtraction could not match (a kernel whose name depends on the rows it
    ran with, where the two generations' steps differed)."""
    return {name[:160]: us / 1e3 / max(1, steps) for name, us, launches in decode if launches % max(1, steps)}


@contextlib.contextmanager
def sampling_engine(trainer: Any) -> Iterator[Any]:
    """The engine ready to sample from the live policy as a training generation would, for the block; yields
    `llm.generate`'s extra keyword arguments (the LoRA request where vLLM samples through its LoRA slots)."""
    from ..vllm.engine_plan import engine_state
    from ..vllm.session import generating  # a training generation's order, and its way out

    generation = trainer.vllm_generation
    llm = generation.llm
    state = engine_state(generation)
    if state is None:  # stock TRL: wake the sleeping engine and push the weights, as its generation does
        engine = getattr(llm, "llm_engine", None)
        if engine is not None and getattr(engine, "is_sleeping", lambda: False)():
            llm.wake_up()
        generation.sync_weights()
        yield {}
        return
    generation.sync_weights()
    with generating(llm, state, trainer.accelerator.device):
        yield {} if state.merged is not None else {"lora_request": state.lora_request}


WALL_REPEATS = 3


def decode_wall_s(generate: Callable[[int], float], tokens: int, repeats: int = WALL_REPEATS) -> float:
    """The wall time of a `tokens`-token generation's last `tokens - short_tokens(tokens)` decode steps: the fastest
    of `repeats` whole generations less the fastest of `repeats` short ones (a host stall in a single run would
    otherwise move the difference by as much as the stall)."""
    whole = min(generate(tokens) for _ in range(repeats))
    short = min(generate(short_tokens(tokens)) for _ in range(repeats))
    return max(0.0, whole - short)


def measure(llm: Any, prompts: list[dict[str, Any]], tokens: int, rounds: int = 1,
            extra: dict[str, Any] | None = None, sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    """The last half of the decode steps of one `tokens`-token generation of `prompts`: timed, then profiled, each as
    the whole generation less one of `short_tokens(tokens)` (`rounds`: the waves the engine runs the prompts in).
    Every generation starts from an empty prefix cache, so each one's prefill is the same work and the difference
    leaves it out (a cache that kept some of the prompts' pages would make that run's prefill shorter than the
    other's). `sampling`: further `SamplingParams` fields, over TRL's. Refused (ValueError) where the prefill's chunks
    would reach into the measured steps."""
    short = short_tokens(tokens)
    scheduler = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "scheduler_config", None)
    per_wave = min(len(prompts), getattr(scheduler, "max_num_seqs", None) or len(prompts))  # the first wave is full
    chunks = prefill_steps(per_wave, len(prompts[0]["prompt_token_ids"]),
                           getattr(scheduler, "max_num_batched_tokens", None))
    if chunks >= short:
        raise ValueError(f"the prefill of {per_wave} prompts takes up to {chunks} steps, not fewer than the "
                         f"{short}-token generation subtracted: profile at least {2 * (chunks + 1)} tokens")
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams

    def generate(max_tokens: int) -> float:
        params = SamplingParams(**{"max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0, "logprobs": 0,
                                   **(sampling or {})})
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False, **(extra or {}))
        torch.cuda.synchronize()
        return time.perf_counter() - start

    generate(tokens)  # warm-up: this batch's CUDA graphs
    wall_s = decode_wall_s(generate, tokens)
    totals = []
    for max_tokens in (tokens, short):
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            generate(max_tokens)
        totals.append(kernel_totals(profiler))
    if not totals[0]:
        raise RuntimeError("the profiler saw no GPU kernel: the engine runs in another process "
                           "(VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps it in this one)")
    decode = decode_kernels(*totals)
    steps = (tokens - short) * rounds
    return {**summarize(decode, steps=steps, wall_s=wall_s), "waves": rounds,
            "uneven_kernels": uneven_kernels(decode, steps)}


def probe_prompts(batch: int, prompt_len: int) -> list[dict[str, Any]]:
    """`batch` distinct prompts of `prompt_len` token ids, the same on every run."""
    return [{"prompt_token_ids": [3 + (7 * i + j) % 50 for j in range(prompt_len)]} for i in range(batch)]


def probe(trainer: Any, batches: Sequence[int], *, tokens: int = PROBE_TOKENS,
          prompt_len: int = PROBE_CONTEXT) -> dict[str, Any]:
    """Profile the decode steps of one `tokens`-token generation of each batch size in `batches`, after prompts of
    `prompt_len` tokens, through the trainer's engine."""
    generation = trainer.vllm_generation
    max_num_seqs = getattr(generation, "max_num_seqs", None)
    results: dict[str, Any] = {"tokens": tokens, "prompt_len": prompt_len, "max_num_seqs": max_num_seqs}
    with sampling_engine(trainer) as extra:
        for batch in batches:
            summary = measure(generation.llm, probe_prompts(batch, prompt_len), tokens, waves(batch, max_num_seqs),
                              extra)
            results[str(batch)] = summary
            print(format_profile(batch, summary), flush=True)
    return results
