"""A GRPO run whose numbers do not depend on how the batch is split over processes, for comparing strategies.

Run it as one process (`python -m trl_turbo.testing.multi_gpu --out ref.json`) or under `accelerate launch` with
any of TRL's accelerate configs. Design: sampling is the only part of a GRPO step that depends on the split (each
rank samples its own prompts from its own RNG stream), so completions here are a fixed function of the prompt and of
the completion's index in its group (`deterministic_completions`), and rewards a fixed function of the text. With
the same global batch, an N-process run and a one-process run then train on the same samples, and their loss curves
may differ only by float reassociation (gradient all-reduce, sharded optimizer steps). Everything else is the real
trainer with trl_turbo's features on: fused loss, offloaded checkpointing, tiled MLP, sequence groups, lean norms
(those a strategy supports; config validation switches the others off).

Rank 0 writes a JSON file: per-step losses, trl_turbo's metrics, and each rank's peak device memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch

from trl_turbo.offload.install import runtime_of
from trl_turbo.patches import trl_internals

GLOBAL_BATCH = 8
NUM_GENERATIONS = 4
MAX_COMPLETION = 64


def deterministic_completions(trainer: Any, pad_id: int, eos_id: int, first_token: int, vocab_size: int) -> None:
    """Replace sampling on `trainer` (instance attribute): row i's completion is drawn from a generator seeded by its
    prompt (without padding, which depends on the batch) and by how many earlier rows of this batch had the same
    prompt; its length varies, EOS ends all but full-length ones."""

    def _generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        seen: dict[tuple[int, ...], int] = {}
        completions = []
        for prompt in prompt_ids:
            key = tuple(int(t) for t in prompt if int(t) != pad_id)
            index = seen.get(key, 0)
            seen[key] = index + 1
            generator = torch.Generator().manual_seed(zlib.crc32(repr((key, index)).encode()))
            length = int(torch.randint(MAX_COMPLETION // 2, MAX_COMPLETION + 1, (1,), generator=generator))
            tokens = torch.randint(first_token, vocab_size, (length,), generator=generator).tolist()
            if length < MAX_COMPLETION:
                tokens[-1] = eos_id
            completions.append(tokens)

        return completions, None

    trl_internals.replace_generation(trainer, _generate_single_turn)


def run_launch(command: list[str], *, timeout: float | None, cwd: Any = None, env: dict[str, str] | None = None,
               capture: bool = True) -> subprocess.CompletedProcess:
    """Run a multi-process launch (`torch.distributed.run`, `accelerate launch`) to completion, capturing its output
    unless `capture=False`. On timeout the launcher gets SIGTERM first, on which it stops its workers: they run in
    sessions of their own, so killing only the launcher (what `subprocess.run(timeout=...)` does) would leave them
    running. Raises `subprocess.TimeoutExpired` with the output so far."""
    pipe = subprocess.PIPE if capture else None
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=pipe, stderr=pipe, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            stdout, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr) from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def per_rank_reports(script: str, workdir: Path, processes: int = 2, timeout: float = 600) -> list[dict[str, Any]]:
    """Run `script` (Python source) on `processes` CPU ranks with `torch.distributed.run` in `workdir`, its first
    argument the report path each rank suffixes with `.<rank>`; return the ranks' JSON reports in rank order (the
    launch must succeed)."""
    path = Path(workdir) / "per_rank_script.py"
    path.write_text(script)
    report = Path(workdir) / "report.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               str(path), str(report)]
    result = run_launch(command, cwd=workdir, timeout=timeout, env=fresh_rendezvous_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return [json.loads(Path(f"{report}.{rank}").read_text()) for rank in range(processes)]


def fresh_rendezvous_env() -> dict[str, str]:
    """`os.environ` for a child launch, without the rendezvous variables an earlier launch or an in-process engine
    (TRL's colocate sets MASTER_PORT etc.) left behind, which would make the child join or collide with it."""
    stale = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
    return {name: value for name, value in os.environ.items() if name not in stale}


def text_reward(completions: list[Any], **_: Any) -> list[float]:
    """A fixed function of the completion (text or chat messages) in [0, 1), with a spread."""
    return [zlib.crc32(repr(completion).encode()) % 1000 / 1000 for completion in completions]


class _StepPeaks:
    """This rank's torch peak at the end of each training step, read just before trl_turbo's step metrics reset it
    (they log each step's peak), so the run's peak survives the resets. A context manager: the reading is installed
    through `registry.scoped` and removed however the run ends."""

    def __init__(self) -> None:
        self.bytes: list[int] = []
        self._scope = contextlib.ExitStack()

    def __enter__(self) -> _StepPeaks:
        from trl_turbo import registry
        from trl_turbo.grpo import step_metrics

        original = step_metrics.step_values

        def step_values(trainer: Any) -> dict[str, float]:
            if torch.cuda.is_available():
                self.bytes.append(torch.cuda.max_memory_allocated())
            return original(trainer)

        self._scope.enter_context(registry.scoped(step_metrics, "step_values", step_values))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._scope.close()


def run(out: str, steps: int, variant: str) -> None:
    from accelerate import PartialState
    from peft import LoraConfig

    from trl_turbo.tasks import arithmetic
    from trl_turbo.testing import parity
    from trl_turbo.testing.models import tiny_model
    from trl_turbo.testing.tokenizer import EOS_ID, PAD_ID, SPECIAL_TOKENS, VOCAB, build_tokenizer

    state = PartialState(cpu=not torch.cuda.is_available())
    with parity.patch_state(variant):
        from trl import GRPOConfig, GRPOTrainer

        # turbo: every layer checkpointed and offloaded, every MLP tiled ("auto" would keep this small model whole)
        overrides = {"turbo_memory_plan": "min"} if variant == "turbo" else parity.ALL_FEATURES_OFF
        config = GRPOConfig(**parity.base_config_kwargs(
            out + ".trainer", use_cpu=not torch.cuda.is_available(), max_steps=steps,
            per_device_train_batch_size=GLOBAL_BATCH // state.num_processes,
            num_generations=NUM_GENERATIONS, max_completion_length=MAX_COMPLETION, gradient_checkpointing=True,
            learning_rate=1e-3, turbo_tiled_mlp_tokens=64, turbo_forward_token_budget=200, **overrides))
        torch.manual_seed(0)
        # Hidden size 2048: a two-sequence group's layer input (~1.5 MB in fp32) passes the offloader's 1 MiB floor.
        model = tiny_model("llama", vocab_size=len(VOCAB), hidden_size=2048, layers=4, tie_word_embeddings=False,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=128)
        trainer = GRPOTrainer(
            model=model, reward_funcs=[text_reward], args=config, processing_class=build_tokenizer(),
            train_dataset=arithmetic.load_dataset("train").select(range(64)),
            peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0),
        )
        deterministic_completions(trainer, PAD_ID, EOS_ID, len(SPECIAL_TOKENS), len(VOCAB))
        with _StepPeaks() as step_peaks:
            start = time.perf_counter()
            trainer.train()
        elapsed = time.perf_counter() - start
    peak_bytes = max([torch.cuda.max_memory_allocated(), *step_peaks.bytes]) if torch.cuda.is_available() else 0
    peak = torch.tensor([peak_bytes / 2**30], device=state.device)  # CPU: 0, a harness check only
    peaks = trainer.accelerator.gather(peak).tolist()
    history = [log for log in trainer.state.log_history if "loss" in log]
    if state.is_main_process:
        result = {
            "variant": variant, "processes": state.num_processes,
            "distributed_type": str(trainer.accelerator.distributed_type), "train_s": elapsed,
            "losses": [log["loss"] for log in history],
            "metrics": {key: [log.get(key) for log in history] for key in sorted(history[-1])
                        if key.startswith(("offload/", "memory/", "reward", "completions/"))},
            "peak_gib_per_rank": peaks,
            "turbo_checkpointing": runtime_of(trainer.model) is not None,
        }
        with open(out, "w") as handle:
            json.dump(result, handle, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--variant", choices=("stock", "turbo"), default="turbo")
    args = parser.parse_args()
    try:
        run(args.out, args.steps, args.variant)
    finally:
        end_process_group()


def end_process_group() -> None:
    """Destroy the default process group while the interpreter is alive: left to interpreter shutdown, gloo's worker
    threads can still hold tensors whose release needs the GIL, and the process aborts (SIGABRT, "terminate called
    without an active exception") after a finished run."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def leave_finished_process() -> None:
    """The last call of a multi-process script that has written its results: destroy the process group, then exit
    with status 0 without interpreter teardown. Even after `end_process_group`, a gloo or store thread torn down with
    the interpreter has aborted a finished run (SIGABRT, "terminate called without an active exception")."""
    import sys

    end_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
