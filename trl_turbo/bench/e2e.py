"""``python -m trl_turbo.bench e2e``: whole GRPO steps (vLLM generation, reward scoring, training) of stock TRL's
colocated vLLM against trl_turbo's shared-weight engine.

Design decision: each variant runs in its own child process, started one after the other by this command, on the
same saved checkpoint, prompts, rewards and seeds. A vLLM engine lives as long as its process (its distributed state
and CuMem pools are not meant to be torn down and rebuilt), and a process is what a user runs, so that is the unit
measured. Device memory is sampled from the driver (``cudaMemGetInfo`` every 20 ms), because vLLM's pools bypass
the statistics of torch's allocator; the step time is wall time between TRL's step callbacks, with the device
synchronised. The instrumentation (timers around ``VLLMGeneration.generate``/``sync_weights`` on the instance, as
scoped ``trl_turbo.registry`` patches that last for the training run, and a callback) is the same for both variants
and changes no behaviour. The checkpoint is a random-init model of a named shape, saved once with a word-level
tokenizer over its whole vocabulary (nothing is downloaded).
Each row also gets its roofline (`bench.roofline`): generation against its decode floor and the training phase's
model FLOP utilization, under the read bandwidth and matmul rate measured once per command (`bench.hardware`).

Peers: the ``unsloth`` variants run Unsloth's own GRPO recipe in a child of their own (`peers`, `unsloth_child`),
measured by the same code (`measure`).

Side by side (``--side-by-side``): on a machine with enough GPUs, every variant's child runs at the same time on
GPUs of its own (``CUDA_VISIBLE_DEVICES``, a rendezvous port each), so one command compares them on one machine in
the time of the slowest; each child is still alone on its devices.

Several GPUs: a launch other than ``1gpu`` names one of TRL's shipped accelerate configs (``multi_gpu``, ``zero2``,
…); the variant's child is then ``accelerate launch`` of this module, each rank samples its own GPU and writes its
own row, and the driver merges them (peak: the largest of any GPU; step time: the slowest rank's median). Every rank
takes a whole group of generations per step, so N GPUs do N times the work of one per step, and throughput is
completion tokens per second over all GPUs.

Synthetic rollouts (a spec's `rollouts`, set by ``bench train --launch``): the child builds no vLLM engine and
`synthetic.synthetic_rollouts` stands in for TRL's generation, so whole optimizer steps measure the training phase
under a launch that wraps the model only inside `Trainer.train()`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .. import registry
from ..device_memory import cap_process_memory
from ..planning.shapes import QUANTIZATIONS, SHAPES, build_config
from ..testing.multi_gpu import fresh_rendezvous_env, run_launch
from . import decode_profile, engine_requests, parse_turbo_overrides, peers, step_profile
from .gpu_children import SINGLE_GPU, free_port, launch_command, visible_devices
from .hardware import measure_apart as measure_hardware
from .layerwise_checkpoint import save_layerwise_checkpoint
from .peers import PEER_VARIANTS
from .results import DEFAULT_RESULTS_DIR, GIB
from .roofline import format_roofline, row_roofline
from .synthetic import synthetic_rollouts

# What each variant adds to the common GRPOConfig. Stock is TRL's colocate mode with sleep mode (level 2: weights and
# KV cache dropped between generations) at TRL's default memory share; turbo is every trl_turbo default plus the
# shared-weight engine with KV standby.
VARIANT_CONFIG: dict[str, dict[str, Any]] = {
    "stock": {"vllm_enable_sleep_mode": True},
    "turbo": {"turbo_vllm_shared_weights": True, "turbo_vllm_standby": True},  # merged sampling (the default)
    "turbo-lora": {"turbo_vllm_shared_weights": True, "turbo_vllm_standby": True, "turbo_vllm_sampling": "lora"},
    "turbo-min": {"turbo_vllm_shared_weights": True, "turbo_vllm_standby": True, "turbo_memory_plan": "min"},
    "turbo-fp8": {"turbo_vllm_shared_weights": True, "turbo_vllm_standby": True, "turbo_vllm_sampling": "fp8",
                  "turbo_vllm_kv_cache_dtype": "fp8", "vllm_importance_sampling_mode": "token_truncate"},
}
# Named workloads: `anchor` is the shape every earlier e2e file measured (one prompt's group per step); `realistic`
# is a GRPO batch as users run it: 8 prompts x 8 generations of 2048 tokens per step, trained in micro-batches of 16.
PRESETS: dict[str, dict[str, int]] = {
    "anchor": {"prompts": 1, "generations": 8, "completion_len": 4096, "micro_batch": 8},
    "realistic": {"prompts": 8, "generations": 8, "completion_len": 2048, "micro_batch": 16},
}
VARIANTS = (*VARIANT_CONFIG, *PEER_VARIANTS)  # the peers run their own recipe (`peers`)
CHECKPOINT_MARKER = "trl_turbo_checkpoint.json"
LORA = {"r": 16, "alpha": 16, "target_modules": "all-linear"}  # every variant's adapter (unless full fine-tuning)
SYNTHETIC = "synthetic"  # a spec's `rollouts`: no vLLM engine, generation replaced by `synthetic_rollouts`
SAMPLE_PERIOD_S = 0.02
TIMELINE_PERIOD_S = 0.25


# ------------------------------------------------------------------------------------------------ checkpoint
SPECIAL_TOKENS = ("<unk>", "<eos>", "<pad>", "<bos>")  # ids 0-3; the model config uses the same ids


def wordlevel_tokenizer(vocab_size: int) -> Any:
    """Ids 0-3 are special tokens, id i >= 4 is the word ``t{i}``, split on whitespace: every id a random model
    samples decodes, and every prompt word is one token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    unk, eos, pad, bos = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=unk, eos_token=eos, pad_token=pad,
                                   bos_token=bos)


# How every variant loads the checkpoint. No `quantization_config`: `prepare_checkpoint` saves a 4-bit run's
# checkpoint already quantized, and transformers refuses a second, dict-typed config for it.
MODEL_INIT_KWARGS = {"dtype": "bfloat16", "attn_implementation": "sdpa"}


def prepare_checkpoint(shape: str, path: Path, seed: int, device: str,
                       quantization: str = "none") -> dict[str, Any]:
    """Save a random-init bf16 model of ``shape`` and its tokenizer to ``path`` (reused when already there); with a
    4-bit ``quantization`` saved already quantized, and then or where the whole model would not fit the device, one
    decoder layer at a time (`layerwise_checkpoint`)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = build_config(shape)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 3, 1, 2
    four_bit = bool(QUANTIZATIONS[quantization].get("load_in_4bit"))
    # a layer at a time where the whole model would not fit the device (a 70B shape on one GPU); the two writers
    # draw the same seed's weights in another order, so the identity says which one wrote them
    layerwise = four_bit or not whole_model_fits(config, device)
    identity = json.loads(json.dumps({"shape": shape, "model_config": SHAPES[shape], "seed": seed,
                                      "quantization": quantization, "writer": "layerwise" if layerwise else "whole"}))
    marker = path / CHECKPOINT_MARKER
    if marker.exists() and json.loads(marker.read_text()) == identity:
        return identity
    path.mkdir(parents=True, exist_ok=True)
    for stale in [*path.glob("*.safetensors"), path / "model.safetensors.index.json", marker]:
        stale.unlink(missing_ok=True)  # another shape's or precision's weights would shadow or confuse the new ones
    if layerwise:
        save_layerwise_checkpoint(config, path, seed, device, QUANTIZATIONS[quantization] if four_bit else None)
    else:
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(path)
        del model
    wordlevel_tokenizer(config.vocab_size).save_pretrained(path)
    marker.write_text(json.dumps(identity))
    return identity


def whole_model_fits(config: Any, device: str, headroom: float = 0.9) -> bool:
    """Whether the bf16 model of `config` fits in `headroom` of the device's free memory (a CPU always does)."""
    import torch
    from transformers import AutoModelForCausalLM

    if torch.device(device).type != "cuda":
        return True
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    size = sum(param.numel() * param.element_size() for param in model.parameters())
    return size <= headroom * torch.cuda.mem_get_info(torch.device(device))[0]


def load_tokenizer(path: str | Path) -> Any:
    """The checkpoint's word-level tokenizer. Not through AutoTokenizer: transformers maps some model types to their
    own tokenizer class (qwen2 to Qwen2Tokenizer), which rebuilds a BPE model that encodes these words as nothing."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path)


def prompts(count: int, length: int, vocab_size: int, seed: int) -> list[str]:
    """``count`` prompts of exactly ``length`` tokens, none of them special."""
    import random

    rng = random.Random(seed)
    return [" ".join(f"t{rng.randrange(len(SPECIAL_TOKENS), vocab_size)}" for _ in range(length)) for _ in range(count)]


def hashed_reward(completions: list[str], **_: Any) -> list[float]:
    """A reward in [0, 1) that is a fixed function of the completion's text: the same for every variant, with a
    spread, so advantages are not zero."""
    return [zlib.crc32(text.encode()) % 1000 / 1000 for text in completions]


# --------------------------------------------------------------------------------------------- instrumentation
class MemorySampler:
    """Samples device memory in use (driver view) on a thread; keeps per-phase peaks and a coarse timeline."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.phase = "setup"
        self.peaks: dict[str, int] = {}
        self.timeline: list[tuple[float, float]] = []
        self._start = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def used(self) -> int:
        import torch

        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def take_peaks(self) -> dict[str, int]:
        peaks, self.peaks = self.peaks, {}
        return peaks

    def _run(self) -> None:
        last_point = -TIMELINE_PERIOD_S
        while not self._stop.is_set():
            used = self.used()
            phase = self.phase
            self.peaks[phase] = max(self.peaks.get(phase, 0), used)
            now = time.perf_counter() - self._start
            if now - last_point >= TIMELINE_PERIOD_S:
                self.timeline.append((round(now, 2), round(used / GIB, 3)))
                last_point = now
            self._stop.wait(SAMPLE_PERIOD_S)


def _timed(sampler: MemorySampler, phase: str, totals: dict[str, float], key: str, function: Any) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        import torch

        previous, sampler.phase = sampler.phase, phase
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            torch.cuda.synchronize()
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - start
            sampler.phase = previous

    return timed


def weight_accounting(trainer: Any) -> dict[str, float]:
    """GiB of HF parameters on the device (a sharded one: this rank's shard), of vLLM's parameters, of HF parameters
    that live inside vLLM's, and what is distinct."""
    model = trainer.model
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    hf = {p.data_ptr(): p.numel() * p.element_size() for p in local if p.device.type == "cuda"}
    spans = []
    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
    if llm is not None:
        from trl_turbo.vllm.engine import driver_model

        spans = [(p.data_ptr(), p.numel() * p.element_size()) for p in driver_model(llm).parameters()]
    vllm_bytes = sum(size for _, size in spans)
    shared = sum(size for ptr, size in hf.items() if any(start <= ptr < start + n for start, n in spans))
    hf_bytes = sum(hf.values())
    return {"hf_weights_gib": hf_bytes / GIB, "vllm_weights_gib": vllm_bytes / GIB,
            "hf_in_vllm_gib": shared / GIB, "distinct_weights_gib": (hf_bytes + vllm_bytes - shared) / GIB}


def cumem_pools() -> dict[str, float]:
    """GiB vLLM allocated in its sleep-mode pools, by tag (both variants run with those pools)."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except ImportError:
        return {}
    pools: dict[str, float] = {}
    for data in CuMemAllocator.get_instance().pointer_to_data.values():
        pools[f"vllm_pool_{data.tag}_gib"] = pools.get(f"vllm_pool_{data.tag}_gib", 0.0) + data.handle[1] / GIB
    return pools


# vLLM's device communicator tries these all-reduces in this order; NCCL is the last resort
_ALL_REDUCES = (("quick", "qr_comm"), ("flashinfer", "fi_ar_comm"), ("custom", "ca_comm"),
                ("symm_mem", "symm_mem_comm"), ("nccl", "pynccl_comm"))


def engine_all_reduces() -> dict[str, list[str]]:
    """The all-reduces the sampling engine's tensor-parallel group brought up (vLLM picks the first that takes a
    tensor): a tensor-parallel decode step all-reduces twice a layer, and without the custom one each goes through
    NCCL. Empty without vLLM or tensor parallelism."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
    except (ImportError, AssertionError):  # no vLLM, or no engine initialised its groups
        return {}
    communicator = getattr(group, "device_communicator", None)
    if communicator is None or getattr(group, "world_size", 1) == 1:
        return {}
    up = [name for name, attribute in _ALL_REDUCES
          if getattr(communicator, attribute, None) is not None
          and not getattr(getattr(communicator, attribute), "disabled", False)]
    return {"vllm_tp_all_reduces": up}


# ---------------------------------------------------------------------------------------------------- worker
_LOGGED = ("loss", "reward", "reward_std", "completions/mean_length", "entropy", "vllm/weight_sync_s",
           "vllm/shared_weights_gib", "vllm/separate_copy_gib", "vllm/weight_copy_s", "vllm/weight_map_s",
           "vllm/weight_cast_s", "vllm/weight_reload_s", "vllm/released_copies_gib",
           "vllm/generation_s", "vllm/kv_released_gib", "vllm/kv_restored_gib", "memory/device_peak_gib/max",
           "vllm/generation_used_gib", "sampling/sampling_logp_difference/mean",
           "sampling/importance_sampling_ratio/mean", "sampling/sampling_logp_difference/p95", "vllm/merge_s",
           "vllm/restore_s", "vllm/quantize_s", "vllm/fp8_resident_gib", "vllm/unpark_s",
           "memory_plan/kept_layers", "memory_plan/device_layers", "memory_plan/offloaded_layers",
           "memory_plan/layer_activation_gib", "memory_plan/predicted_peak_gib", "memory_plan/spendable_gib",
           "memory_plan/ceiling_gib", "memory_plan/allocated_gib", "memory/reserved_peak_gib")


def new_row(spec: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The fields every row starts with, from its spec (and `extra`, such as a memory cap's)."""
    return {**extra, "variant": spec["variant"], "shape": spec["shape"], "quantization": spec["quantization"],
            "launch": spec["launch"], "generations": spec["generations"], "prompts": spec["prompts"],
            "micro_batch": spec["micro_batch"], "prompt_len": spec["prompt_len"],
            "completion_len": spec["completion_len"], "ok": False, "error": None,
            "rank": int(os.environ.get("RANK", 0)), "processes": int(os.environ.get("WORLD_SIZE", 1)),
            "vllm_tp": spec.get("vllm_tp", 1),
            "engine_requests": list(spec.get("engine_requests") or []) if takes_requests(spec["variant"]) else []}


def takes_requests(variant: str) -> bool:
    """Whether `--engine-request` reaches this variant's engine: trl_turbo's variants, not stock's or a peer's."""
    return variant in VARIANT_CONFIG and variant != "stock"


def others_before(spec: dict[str, Any], device: Any) -> int:
    """Bytes other processes held on `device` when the variant started: the driver's reading of GPU 0 (its own CUDA
    context is there); a launched rank on another GPU has it alone."""
    return spec["device_used_before"] if device.index in (None, 0) else 0


def capped_engine_share(sized_by_share: bool, utilization: float, cap_bytes: int, total_bytes: int) -> float:
    """The `vllm_gpu_memory_utilization` a variant runs with under a cap: vLLM takes its share of the device's whole
    memory, so an engine sized by that share (stock's, or a variant that sets it) gets the same share of the device
    the cap stands for (an H100's 0.3 under a 79.1 GiB cap on an H200); trl_turbo's automatic KV budget sizes its
    engine from the memory free (unchanged)."""
    return utilization * min(cap_bytes, total_bytes) / total_bytes if sized_by_share else utilization


def grpo_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """The GRPOConfig every variant shares: the workload, the optimizer and TRL's colocated vLLM."""
    per_step = spec["prompts"] * spec["generations"]  # completions generated (and trained on) per optimizer step
    return dict(
        output_dir=spec["output_dir"], seed=spec["seed"], bf16=True, beta=0.0, learning_rate=1e-5,
        per_device_train_batch_size=spec["micro_batch"], gradient_accumulation_steps=per_step // spec["micro_batch"],
        num_generations=spec["generations"],
        max_completion_length=spec["completion_len"], max_steps=spec["steps"], logging_steps=1,
        report_to="none", save_strategy="no",
        use_vllm=spec.get("rollouts") != SYNTHETIC, vllm_mode="colocate",
        vllm_max_model_length=spec["prompt_len"] + spec["completion_len"],
        vllm_tensor_parallel_size=spec.get("vllm_tp", 1),
        generation_kwargs={"ignore_eos": True},  # every completion runs to the cap: the same work for each variant
    )


def workload_dataset(spec: dict[str, Any], tokenizer: Any) -> Any:
    """The prompts of every step of every rank."""
    from datasets import Dataset

    processes = int(os.environ.get("WORLD_SIZE", 1))
    return Dataset.from_dict({"prompt": prompts(spec["steps"] * processes * spec["prompts"], spec["prompt_len"],
                                                tokenizer.vocab_size, spec["seed"])})


def run_variant(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the trainer of one of stock TRL's or trl_turbo's variants, train ``steps`` steps, return its row (runs in
    the child process)."""
    import torch
    from peft import LoraConfig

    from .. import run_plan
    from . import set_patched

    variant = spec["variant"]
    set_patched(variant != "stock")
    if takes_requests(variant) and spec.get("engine_requests"):
        engine_requests.apply(spec["engine_requests"])
    from trl import GRPOConfig, GRPOTrainer

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    torch.cuda.set_device(device)
    torch.cuda.init()
    cap = (cap_process_memory(int(spec["gpu_gib"] * GIB), device, others_bytes=others_before(spec, device))
           if spec.get("gpu_gib") is not None else {})
    config = GRPOConfig(**grpo_kwargs(spec), gradient_checkpointing=True,
                        model_init_kwargs=dict(MODEL_INIT_KWARGS),  # a 4-bit checkpoint is saved quantized
                        **spec["variant_config"][variant])
    if cap:
        sized_by_share = variant == "stock" or "vllm_gpu_memory_utilization" in spec["variant_config"][variant]
        share = capped_engine_share(sized_by_share, config.vllm_gpu_memory_utilization, int(spec["gpu_gib"] * GIB),
                                    torch.cuda.mem_get_info(device)[1])
        config.vllm_gpu_memory_utilization = cap["vllm_gpu_memory_utilization"] = share
    tokenizer = load_tokenizer(spec["checkpoint"])
    dataset = workload_dataset(spec, tokenizer)  # outside the timed start-up, as for every variant

    def build() -> Any:
        trainer = GRPOTrainer(
            model=spec["checkpoint"], reward_funcs=hashed_reward, args=config,
            train_dataset=dataset, processing_class=tokenizer,
            peft_config=None if spec.get("lora") is None else LoraConfig(
                r=spec["lora"]["r"], lora_alpha=spec["lora"]["alpha"],
                target_modules=spec["lora"]["target_modules"], task_type="CAUSAL_LM"),
        )
        if spec.get("rollouts") == SYNTHETIC:  # the training phase only: TRL's generation gives way to made-up rollouts
            trainer._generate_and_score_completions = synthetic_rollouts(
                spec["prompt_len"], spec["completion_len"], SHAPES[spec["shape"]]["vocab_size"], device,
                int(os.environ.get("WORLD_SIZE", 1)), spec["seed"])
        return trainer

    def describe(trainer: Any, row: dict[str, Any]) -> None:
        row["liger_layers"] = variant != "stock" and run_plan.of(trainer).memory.liger  # resolved from auto
        if variant != "stock":
            row["run_plan"] = run_plan.of(trainer).describe()  # the decisions the row was measured under
        # the plan's mode: under FSDP2 the engine sets it up only when training starts
        engine = run_plan.of(trainer).engine if variant != "stock" else None
        row["sampling"] = None if engine is None or engine.sampling is None else engine.sampling.value

    def profile_decode(trainer: Any, row: dict[str, Any]) -> None:
        context = spec.get("profile_context", decode_profile.PROBE_CONTEXT)
        row["decode_profile"] = decode_profile.probe(trainer, spec["profile_decode"], prompt_len=context)

    return measure(spec, device, build, describe, new_row(spec, **cap),
                   after=profile_decode if spec.get("profile_decode") else None)


def measure(spec: dict[str, Any], device: Any, build: Any, describe: Any, row: dict[str, Any],
            after: Any = None) -> dict[str, Any]:
    """Build a trainer with `build()`, let `describe(trainer, row)` add what only that variant knows, train it under
    the instrumentation every variant shares, then let `after(trainer, row)` probe it, and return `row` with its
    steps: the one way a row is measured, for TRL's variants and the peers' alike."""
    import torch

    steps: list[dict[str, Any]] = []
    trainer = None
    with MemorySampler(device) as sampler:
        try:
            start = time.perf_counter()
            trainer = build()
            torch.cuda.synchronize()
            row["init_s"] = time.perf_counter() - start
            row["init_used_gib"] = sampler.used() / GIB
            row["init_peak_gib"] = max(sampler.take_peaks().values(), default=0) / GIB
            describe(trainer, row)

            def account() -> None:  # read through vLLM's internals: a reading that fails loses only itself
                try:
                    row.update(weight_accounting(trainer))
                    row.update(cumem_pools())
                    row.update(engine_all_reduces())
                except Exception as exc:
                    row["accounting_error"] = f"{type(exc).__name__}: {exc}"

            has_engine = getattr(trainer, "vllm_generation", None) is not None  # none with synthetic rollouts
            if has_engine:
                account()

            def save_progress() -> None:  # a variant stopped by its timeout still leaves its finished steps
                if len(steps) == 1 and has_engine:
                    account()  # again: FSDP2 shards the model (and shares its shards) only when training starts
                partial = {**row, "error": "stopped before the last step", "steps": steps,
                           "timeline": sampler.timeline, **summarize(steps, spec["warmup"])}
                _row_path(spec).write_text(json.dumps(partial))

            save_progress()
            with _instrument(trainer, sampler, steps, save_progress, spec.get("profile_step")):
                trainer.train()
            row["ok"] = True
            if after is not None:
                try:
                    after(trainer, row)
                except Exception as exc:  # a probe that fails loses only itself
                    traceback.print_exc()
                    row["probe_error"] = f"{type(exc).__name__}: {exc}"
        except torch.OutOfMemoryError as exc:
            traceback.print_exc()
            row["error"] = "OOM"
            row["oom_message"] = str(exc)[:1000]  # how much was asked, held and cached when it failed
        except Exception as exc:  # recorded, so the other variant still runs and the file is written
            traceback.print_exc()
            row["error"] = f"{type(exc).__name__}: {exc}"
            row["traceback"] = traceback.format_exc()[-4000:]  # the file keeps where it failed
        row["timeline"] = sampler.timeline
    history = trainer.state.log_history if trainer is not None else []
    logs = [{key: log[key] for key in _LOGGED if key in log} for log in history if "loss" in log]
    for step, log in zip(steps, logs):
        step.update(log)
    row["steps"] = steps
    row.update(summarize(steps, spec["warmup"]))
    return row


def _row_path(spec: dict[str, Any]) -> Path:
    return Path(spec["row_dir"], f"row{os.environ.get('RANK', 0)}.json")


@contextlib.contextmanager
def _instrument(trainer: Any, sampler: MemorySampler, steps: list[dict[str, Any]], on_step: Any,
                profile_step: int | None = None) -> Iterator[None]:
    """For the block: time generation and weight sync (scoped registry patches on the instance) and record each
    step's time and phase peaks (then call `on_step`); the step of index `profile_step` also under the profiler
    (`step_profile`)."""
    import torch
    from transformers import TrainerCallback

    generation, phases = getattr(trainer, "vllm_generation", None), {}
    profiling = contextlib.ExitStack()

    class StepRecorder(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            torch.cuda.synchronize()
            # what the device held since start-up or the last step: before the first, accelerate's preparation
            # inside `train()` (FSDP2 shards the model there), part of the run's peak like any step
            self.before = max(sampler.take_peaks().values(), default=0)
            sampler.phase = "train"
            phases.clear()
            self.kernels = profiling.enter_context(step_profile.profiled()) if len(steps) == profile_step else None
            self.start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            torch.cuda.synchronize()
            step_s = time.perf_counter() - self.start
            peaks = sampler.take_peaks()
            steps.append({"step_s": step_s, **phases,
                          **{f"{phase}_peak_gib": used / GIB for phase, used in peaks.items()},
                          "before_peak_gib": self.before / GIB,
                          "peak_gib": max(self.before, *peaks.values()) / GIB})
            if self.kernels is not None:
                try:  # a profile that fails loses only itself, never the row's timed steps
                    profiling.close()  # fills self.kernels
                    steps[-1]["profile"] = step_profile.summarize_step(self.kernels, step_s)
                    print(f"[rank {os.environ.get('RANK', 0)}] {step_profile.format_step(steps[-1]['profile'])}",
                          flush=True)
                except Exception as exc:
                    traceback.print_exc()
                    steps[-1]["profile"] = {"error": f"{type(exc).__name__}: {exc}"}
                self.kernels = None
            sampler.phase = "between"
            on_step()

    trainer.add_callback(StepRecorder())
    with profiling:  # a step that raised under the profiler: the profiler stops with the block
        if generation is None:  # synthetic rollouts: no engine to time
            yield
            return
        with (registry.scoped(generation, "generate",
                              _timed(sampler, "generation", phases, "generate_s", generation.generate)),
              registry.scoped(generation, "sync_weights",
                              _timed(sampler, "generation", phases, "sync_s", generation.sync_weights))):
            yield


def summarize(steps: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Medians over the steps after ``warmup`` (None while there is none: a warm-up step is never reported as
    timed), a profiled step left out; the peak is the largest of any step, warm-up included."""
    timed = [step for step in steps[warmup:] if "profile" not in step]
    summary: dict[str, Any] = {"peak_gib": max((s["peak_gib"] for s in steps), default=None)}
    for key in ("step_s", "generate_s", "sync_s", "generation_peak_gib", "train_peak_gib"):
        values = [s[key] for s in timed if key in s]
        summary[key] = statistics.median(values) if values else None
    return summary


# ------------------------------------------------------------------------------------------------------ driver


def side_by_side_devices(processes: list[int], devices: list[str]) -> list[list[str]]:
    """Disjoint consecutive groups of `devices`, `processes[i]` GPUs for job i; refused when there are too few."""
    if sum(processes) > len(devices):
        raise SystemExit(f"--side-by-side needs {sum(processes)} GPUs for these variants and launches, this machine "
                         f"shows {len(devices)}: drop variants or run them one after the other")
    starts = [sum(processes[:index]) for index in range(len(processes))]
    return [devices[start:start + count] for start, count in zip(starts, processes, strict=True)]


def merge_ranks(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from each rank's: rank 0's, with the peaks the largest of any GPU, the step time the slowest rank's,
    and every rank's peak and step time kept."""
    rows = sorted(rows, key=lambda row: row.get("rank", 0))
    merged = dict(rows[0])
    if len(rows) == 1:
        return merged
    merged["ok"] = all(row.get("ok") for row in rows)
    merged["error"] = next((row["error"] for row in rows if row.get("error")), None)
    for key in ("peak_gib", "init_peak_gib", "generation_peak_gib", "train_peak_gib", "step_s", "generate_s",
                "sync_s"):
        values = [row[key] for row in rows if row.get(key) is not None]
        merged[key] = max(values) if values else None
        merged[f"{key}_per_rank"] = [row.get(key) for row in rows]
    merged["timelines_per_rank"] = [row.get("timeline") for row in rows[1:]]
    profiles = [step_profile.profile_of(row) for row in rows]
    if any(profiles):  # a slow rank's waits are the step's
        merged["step_profile_per_rank"] = profiles
    return merged


def run_child(spec: dict[str, Any], timeout_s: float, devices: list[str] | None = None) -> dict[str, Any]:
    """Run one variant's child to completion and return its (rank-merged) row; `devices`: the GPUs it may see (all of
    this process's when None)."""
    processes = spec["processes"]
    with tempfile.TemporaryDirectory() as scratch:
        spec_path = Path(scratch) / "spec.json"
        row_paths = [Path(scratch) / f"row{rank}.json" for rank in range(processes)]
        spec_path.write_text(json.dumps({**spec, "row_dir": scratch}))
        base = fresh_rendezvous_env()
        if devices is not None:  # side by side: its own GPUs, rendezvous port and compile cache
            base.update(CUDA_VISIBLE_DEVICES=",".join(devices), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                        UNSLOTH_COMPILE_LOCATION=str(Path(scratch) / "unsloth_compiled_cache"))
        try:
            if peers.is_peer(spec["variant"]):
                command, env = peers.child_command(spec_path), peers.child_env(base, spec["unsloth_site"])
            else:
                command, env = [*launch_command(spec["launch"], processes), str(spec_path)], base
            process = run_launch(command, timeout=timeout_s, env=env, capture=False)
            failure = None if process.returncode == 0 else f"child exited with {process.returncode}"
        except subprocess.TimeoutExpired:
            failure = f"timed out after {timeout_s:.0f} s"
        rows = [json.loads(path.read_text()) for path in row_paths if path.exists()]
        if len(rows) == processes:
            row = merge_ranks(rows)
        else:  # a rank failed and its launcher stopped the others: the failed rank's row says why
            missing = f"{processes - len(rows)} of {processes} ranks wrote no result"
            failed = next((rank_row for rank_row in rows if not rank_row.get("ok")), {})
            row = {"variant": spec["variant"], "ok": False,
                   **{key: failed[key] for key in ("oom_message", "traceback", "timeline") if key in failed},
                   "error": f"{failed['error']} ({missing})" if failed.get("error") else (failure or missing)}
    row["launch"] = spec["launch"]
    if failure:  # e.g. a crash at interpreter exit after the measurement was written, or a timeout mid-run
        row["error"] = failure if row.get("ok") else f"{failure}: {row.get('error')}"
    return row


def run(args: argparse.Namespace) -> Path:
    import torch

    from .results import metadata

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if set(variants) - set(VARIANTS):
        raise SystemExit(f"unknown variants {sorted(set(variants) - set(VARIANTS))}; choose from {VARIANTS}")
    if args.engine_request and not any(takes_requests(v) for v in variants):
        raise SystemExit("--engine-request asks the turbo variants' engines for a kernel: add a turbo variant")
    if "fp8-gemm" in args.engine_request and "turbo-fp8" not in variants:
        raise SystemExit("--engine-request fp8-gemm replaces the GEMM of fp8 sampling: add the turbo-fp8 variant")
    if args.warmup < 0:
        raise SystemExit(f"--warmup {args.warmup}: a number of steps, 0 or more")
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps {args.steps} with --warmup {args.warmup} leaves no timed step: --steps counts the "
                         "warm-up steps too, so ask for at least --warmup + 1")
    overrides = parse_turbo_overrides(args.turbo_set)
    for variant in variants:
        clash = sorted(set(overrides) & set(VARIANT_CONFIG.get(variant, {})))
        if clash and variant != "stock":
            raise SystemExit(f"--turbo-set {', '.join(clash)}: the variant {variant!r} sets this itself")
    launches = [launch.strip() for launch in args.launches.split(",") if launch.strip()]
    counts = [1] if launches == [SINGLE_GPU] else args.processes
    for count in counts:
        tp = tp_size(args.vllm_tp, count)
        if count % tp:
            raise SystemExit(f"--vllm-tp {args.vllm_tp} must divide --processes {count}")
    refused = peers.refusals(variants, launches, single_gpu=SINGLE_GPU, gpu_gib=args.gpu_gib,
                             full_finetuning=args.full_finetuning,
                             vllm_tp=max(tp_size(args.vllm_tp, count) for count in counts), site=args.unsloth_site,
                             quantization=args.quantization)
    if refused:
        raise SystemExit("; ".join(refused))
    if args.side_by_side and args.gpu_gib is not None:
        raise SystemExit("--gpu-gib caps a variant beside the driver's own CUDA context on GPU 0: run capped variants "
                         "one after the other (leave out --side-by-side)")
    if args.gpu_gib is not None and args.gpu_gib <= 0:
        raise SystemExit(f"--gpu-gib must be a positive number of GiB, got {args.gpu_gib}")
    completion_len = resolve_workload(args)["completion_len"]
    context_room = args.prompt_len + completion_len - decode_profile.PROBE_TOKENS
    if args.profile_decode and not 1 <= args.profile_context <= context_room:
        raise SystemExit(f"--profile-context {args.profile_context}: the probe's prompts must leave its "
                         f"{decode_profile.PROBE_TOKENS} tokens room in the engine's {args.prompt_len} + "
                         f"{completion_len}-token context, so at most {context_room}")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type != "cuda":
        raise SystemExit("the e2e benchmark runs vLLM: it needs a CUDA GPU")
    if args.gpu_gib is not None and args.gpu_gib * GIB > torch.cuda.mem_get_info(device)[1]:
        raise SystemExit(f"--gpu-gib {args.gpu_gib:g} is more than the GPU has")
    for launch in launches:
        launch_command(launch, max(args.processes))  # an unknown launch fails before anything runs
    if args.quantization not in QUANTIZATIONS:
        raise SystemExit(f"unknown quantization {args.quantization!r}; choose from {sorted(QUANTIZATIONS)}")
    workload = resolve_workload(args)
    quantized = "" if args.quantization == "none" else f"-{args.quantization}"
    checkpoint = Path(args.checkpoint or Path(tempfile.gettempdir()) / f"trl-turbo-{args.shape}{quantized}")
    start = time.perf_counter()
    prepare_checkpoint(args.shape, checkpoint, args.seed, "cuda", args.quantization)
    hardware = measure_hardware(device)  # the ceilings of each row's roofline, once per machine and command
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)  # this driver's CUDA context and any other process: not a child's
    print(f"checkpoint {checkpoint} ready in {time.perf_counter() - start:.1f} s", flush=True)
    config = {"shape": args.shape, "model_config": SHAPES[args.shape], "preset": args.preset, **workload,
              "prompt_len": args.prompt_len, "steps": args.steps, "gpu_gib": args.gpu_gib,
              "vllm_tp": args.vllm_tp if args.vllm_tp == TP_PER_PROCESS or len(args.processes) > 1
              else tp_size(args.vllm_tp, args.processes[0]),
              "warmup": args.warmup, "variants": variants, "seed": args.seed,
              "lora": None if args.full_finetuning else LORA,
              "dtype": "bfloat16",
              "quantization": args.quantization, "quantization_config": QUANTIZATIONS[args.quantization] or None,
              "side_by_side": args.side_by_side, "launches": launches, "profile_decode": args.profile_decode,
              "engine_requests": args.engine_request,
              "profile_context": args.profile_context,
              "processes_per_launch": {launch: 1 if launch == SINGLE_GPU else
                                       args.processes[0] if len(args.processes) == 1 else args.processes
                                       for launch in launches},
              "variant_config": {v: variant_config(v, overrides) for v in variants},
              "common_config": {"vllm_mode": "colocate", "beta": 0.0, "gradient_checkpointing": True,
                                "generation_kwargs": {"ignore_eos": True},
                                "vllm_max_model_length": args.prompt_len + workload["completion_len"]}}
    meta = {**metadata("e2e", device, config), "hardware": hardware}
    several = ("" if launches == [SINGLE_GPU] else f"-{'-'.join(map(str, args.processes))}gpu") + (
        "" if launches == [SINGLE_GPU] or args.vllm_tp == 1 else f"-tp{args.vllm_tp}")
    preset = ("" if args.preset == "anchor" else f"-{args.preset}") + ("-full" if args.full_finetuning else "")
    capped = "" if args.gpu_gib is None else f"-cap{args.gpu_gib:g}gib"
    capped += "".join(f"-{name}" for name in sorted(set(args.engine_request)))  # rows that asked for a candidate
    stem = f"e2e-{args.shape}{preset}{quantized}{several}{capped}-{time.strftime('%Y%m%d-%H%M%S')}"
    jobs = [(launch, count, variant) for launch in launches
            for count in ([1] if launch == SINGLE_GPU else args.processes) for variant in variants]
    placements = (side_by_side_devices([count for _, count, _ in jobs], visible_devices(torch.cuda.device_count()))
                  if args.side_by_side else [None] * len(jobs))
    rows: list[dict[str, Any] | None] = [None] * len(jobs)
    written = threading.Lock()

    def run_job(index: int, output_dir: str) -> None:
        launch, count, variant = jobs[index]
        spec = {"variant": variant, "launch": launch, "processes": count,
                "checkpoint": str(checkpoint), "output_dir": str(Path(output_dir) / f"job{index}"),
                "device_used_before": total - free,
                "unsloth_site": args.unsloth_site, **config,
                "vllm_tp": 1 if launch == SINGLE_GPU else tp_size(args.vllm_tp, count)}  # this job's engine
        try:
            row = run_child(spec, args.variant_timeout, placements[index])
        except Exception as exc:  # the other variants, running beside it, go on
            row = {"variant": variant, "launch": launch, "processes": count, "ok": False, "error": repr(exc)}
        row.setdefault("processes", count)  # a failed job's row too, so `scaling` keys it as the others
        row["roofline"] = row_roofline(row, {**config, "vllm_tp": spec["vllm_tp"]}, hardware)
        if placements[index] is not None:
            row["devices"] = placements[index]
        with written:
            rows[index] = row
            print(format_row(row), flush=True)
            print(format_roofline(row, row["roofline"]), flush=True)
            write_results(meta, [r for r in rows if r is not None], Path(args.out), stem)

    with tempfile.TemporaryDirectory() as output_dir:
        if args.side_by_side:
            threads = [threading.Thread(target=run_job, args=(index, output_dir)) for index in range(len(jobs))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        else:
            for index in range(len(jobs)):
                run_job(index, output_dir)
    rows = [row for row in rows if row is not None]
    meta["scaling"] = scaling(rows, workload["completion_len"])
    path = write_results(meta, rows, Path(args.out), stem)
    print(json.dumps(meta["scaling"], indent=1))
    print(f"wrote {path} (+ .png)")
    return path


def variant_config(variant: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """What `variant` adds to the common GRPOConfig (a peer: to its own loader's arguments); the turbo variants also
    take the `--turbo-set` overrides."""
    if peers.is_peer(variant):
        return dict(PEER_VARIANTS[variant])
    return dict(VARIANT_CONFIG[variant]) if variant == "stock" else {**VARIANT_CONFIG[variant], **overrides}


def resolve_workload(args: argparse.Namespace) -> dict[str, int]:
    """The preset's prompts, generations, completion length and micro-batch, each overridden where given."""
    workload = dict(PRESETS[args.preset])
    for key in workload:
        if getattr(args, key, None) is not None:
            workload[key] = getattr(args, key)
    if (workload["prompts"] * workload["generations"]) % workload["micro_batch"]:
        raise SystemExit(f"--micro-batch {workload['micro_batch']} must divide the {workload['prompts']} x "
                         f"{workload['generations']} completions of a step")
    return workload


def scaling(rows: list[dict[str, Any]], completion_len: int) -> dict[str, Any]:
    """Per launch (and GPU count, where a launch ran at several) and variant: completion tokens per second over all
    GPUs, and against the same variant on one GPU (its throughput ratio and the ratio divided by the GPU count, the
    scaling efficiency)."""
    out: dict[str, Any] = {}
    single = {row["variant"]: row for row in rows if row.get("launch") == SINGLE_GPU and row.get("ok")}
    for row in rows:
        if not row.get("ok") or not row.get("step_s"):
            continue
        processes = row.get("processes", 1)
        per_step = row["generations"] * row.get("prompts", 1)
        tokens = per_step * processes * completion_len
        entry = {"processes": processes, "completion_tokens_per_s": tokens / row["step_s"]}
        base = single.get(row["variant"])
        if base is not None and base is not row and base.get("step_s"):
            ratio = entry["completion_tokens_per_s"] / (per_step * completion_len / base["step_s"])
            entry.update({"throughput_vs_1gpu": ratio, "scaling_efficiency": ratio / processes})
        several = len({r.get("processes", 1) for r in rows if r.get("launch") == row["launch"]}) > 1
        launch = f"{row['launch']}x{processes}" if several else row["launch"]
        out[f"{launch}/{row['variant']}"] = entry
    return out


def write_results(meta: dict[str, Any], rows: list[dict[str, Any]], out_dir: Path, stem: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    plot(rows, f"e2e {meta['config']['shape']} on {meta['gpu']}", out_dir / f"{stem}.png")
    return path


def plot(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    """Left: device memory in use over the run, per variant. Right: time per step, split into phases."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (memory, steps) = plt.subplots(1, 2, figsize=(13, 4.5))
    for row in rows:
        if row.get("timeline"):
            xs, ys = zip(*row["timeline"])
            memory.plot(xs, ys, label=_label(row) + (" (GPU 0)" if row.get("processes", 1) > 1 else ""),
                        linewidth=1)
    for cap in sorted({row["cap_gib"] for row in rows if row.get("cap_gib")}):
        memory.axhline(cap, color="black", linestyle=":", linewidth=1, label=f"cap {cap:g} GiB")
    memory.set_xlabel("time since trainer construction (s)")
    memory.set_ylabel("device memory in use (GiB)")
    memory.grid(alpha=0.3)
    names = [_label(row) for row in rows if row.get("steps")]
    for index, row in enumerate(r for r in rows if r.get("steps")):
        sync = [s.get("sync_s", 0.0) for s in row["steps"]]
        generate = [s.get("generate_s", 0.0) for s in row["steps"]]
        rest = [s["step_s"] - g - y for s, g, y in zip(row["steps"], generate, sync)]
        xs = [step + index * 0.4 for step in range(len(row["steps"]))]
        steps.bar(xs, generate, width=0.4, color=f"C{index}", label=f"{_label(row)}: generation")
        steps.bar(xs, sync, width=0.4, bottom=generate, color=f"C{index}", alpha=0.35,
                  label=f"{_label(row)}: weight sync")
        steps.bar(xs, rest, width=0.4, bottom=[g + y for g, y in zip(generate, sync)], color=f"C{index}", alpha=0.7,
                  hatch="//", label=f"{_label(row)}: scoring + training")
    most = max((len(row["steps"]) for row in rows if row.get("steps")), default=0)
    steps.set_xticks([step + 0.2 * (len(names) - 1) for step in range(most)], [str(step + 1) for step in range(most)])
    steps.set_xlabel("step")
    steps.set_ylabel("time (s)")
    if names:
        memory.legend(fontsize=8)
        steps.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _label(row: dict[str, Any]) -> str:
    launch = row.get("launch", SINGLE_GPU)
    return row["variant"] if launch == SINGLE_GPU else f"{row['variant']} {launch}×{row.get('processes')}"


def format_row(row: dict[str, Any]) -> str:
    from . import fmt

    capped = f" (capped at {row['cap_gib']:g} GiB)" if row.get("cap_gib") else ""
    if not row.get("ok"):
        return f"{_label(row):>6}{capped} FAILED: {row.get('error')}"
    if capped:  # the device's peak less what other processes held: the child's own, as the driver counts it
        capped += f" own peak={fmt(row['peak_gib'] - row.get('others_gib', 0.0), '6.2f')} GiB "
    return (f"{_label(row):>6}{capped} init peak={fmt(row.get('init_peak_gib'), '6.2f')} GiB  "
            f"step peak={fmt(row['peak_gib'], '6.2f')} GiB (generation "
            f"{fmt(row['generation_peak_gib'], '6.2f')}, training {fmt(row['train_peak_gib'], '6.2f')})  "
            f"step={fmt(row['step_s'], '6.2f')} s  generate={fmt(row['generate_s'], '6.2f')} s  "
            f"sync={fmt(row['sync_s'], '6.3f')} s  distinct weights={fmt(row['distinct_weights_gib'], '6.2f')} GiB")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("e2e", help="whole GRPO steps with colocated vLLM: stock TRL vs trl_turbo")
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--preset", default="anchor", choices=sorted(PRESETS),
                        help="; ".join(f"{name}: {p['prompts']} prompt(s) x {p['generations']} generations x "
                                       f"{p['completion_len']} tokens, micro-batch {p['micro_batch']}"
                                       for name, p in PRESETS.items()))
    parser.add_argument("--generations", type=int, default=None, help="completions per prompt (preset's if unset)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step (preset's if unset)")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (preset's if unset)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--completion-len", type=int, default=None, help="completion tokens (preset's if unset)")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per variant, the warm-up steps included")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    parser.add_argument("--variants", default="stock,turbo", help=f"comma-separated, among {','.join(VARIANTS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quantization", default="none", choices=sorted(QUANTIZATIONS),
                        help="nf4: QLoRA (bitsandbytes 4-bit NF4, double quantization, bf16 compute)")
    parser.add_argument("--launches", default=SINGLE_GPU,
                        help=f"comma-separated: {SINGLE_GPU} and/or TRL accelerate configs (multi_gpu, zero2, …)")
    parser.add_argument("--processes", type=_batch_sizes, default=[2], metavar="N,N",
                        help="GPUs of each launch other than 1gpu; several (2,4) run each launch at each count, the "
                             "throughput against the 1gpu launch's in the file's `scaling`")
    parser.add_argument("--vllm-tp", type=_tp_option, default=1, metavar=f"T|{TP_PER_PROCESS}",
                        help=f"vLLM's tensor-parallel size under a launch (every variant; a 1gpu job's is 1); "
                             f"{TP_PER_PROCESS!r}: each launch's process count, one engine over all its GPUs"),
    parser.add_argument("--full-finetuning", action="store_true", help="train every weight (no LoRA adapter)")
    parser.add_argument("--gpu-gib", type=float, default=None,
                        help="cap each variant's process (each rank, under a launch) at this much device memory "
                             "(a smaller GPU): torch's per-process fraction, less the CUDA context the driver holds")
    parser.add_argument("--turbo-set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a trl_turbo GRPOConfig field for the turbo variants (repeatable; VALUE as JSON)")
    parser.add_argument("--checkpoint", default=None, help="where the random-init checkpoint is saved (reused)")
    parser.add_argument("--unsloth-site", default=os.environ.get("TRL_TURBO_UNSLOTH_SITE"),
                        help="site directory with Unsloth and its pins, for the unsloth variants (docs/benchmarks.md)")
    parser.add_argument("--side-by-side", action="store_true",
                        help="run the variants at the same time, each on GPUs of its own (variants x launches x "
                             "processes GPUs needed)")
    parser.add_argument("--profile-decode", type=_batch_sizes, default=[], metavar="N,N",
                        help="after its steps, profile a short generation of each batch size through each TRL "
                             "variant's engine (kernel time by class per decode step; `decode_profile`)")
    parser.add_argument("--profile-context", type=int, default=decode_profile.PROBE_CONTEXT, metavar="TOKENS",
                        help="the profiled generations' prompt length: their decode steps run at this context")
    parser.add_argument("--engine-request", action="append", default=[], choices=sorted(engine_requests.REQUESTS),
                        help="the turbo variants' engines ask for this candidate kernel of trl_turbo's (repeatable; "
                             "`bench engine-options` measures it alone)")
    parser.add_argument("--variant-timeout", type=float, default=1200.0, help="seconds before a variant is stopped")
    parser.add_argument("--out", default=str(DEFAULT_RESULTS_DIR), help="results folder")
    parser.set_defaults(func=run)


TP_PER_PROCESS = "all"  # `--vllm-tp all`: each launch's tensor-parallel size is its process count


def _tp_option(text: str) -> int | str:
    if text == TP_PER_PROCESS:
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--vllm-tp takes a positive integer or {TP_PER_PROCESS!r}, got {text!r}")
    return int(text)


def tp_size(option: int | str, processes: int) -> int:
    """vLLM's tensor-parallel size for a launch of `processes` GPUs under the `--vllm-tp` option."""
    return processes if option == TP_PER_PROCESS else int(option)


def _batch_sizes(text: str) -> list[int]:
    sizes = [int(size) for size in text.split(",") if size.strip()]
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers, got {text!r}")
    return sizes


def child_main(spec_path: str, run_child: Callable[[dict[str, Any]], dict[str, Any]] = run_variant) -> None:
    """A variant's child: measure the row of the spec at `spec_path` with `run_child` and save it where the driver
    reads it."""
    spec = json.loads(Path(spec_path).read_text())
    row = run_child(spec)
    _row_path(spec).write_text(json.dumps(row))
    sys.stdout.flush()
    sys.stderr.flush()
    # The measurement is saved; skip interpreter teardown, where an in-process vLLM engine can hang on exit. A rank
    # that failed exits non-zero, so that its launcher stops the other ranks (else they wait in a collective).
    failed_rank = not row.get("ok") and int(os.environ.get("WORLD_SIZE", 1)) > 1
    os._exit(1 if failed_rank else 0)


if __name__ == "__main__":
    child_main(sys.argv[1])
