"""Rollout batches made up for a benchmark: shaped like `GRPOTrainer._generate_and_score_completions`' output.

Design decision: what trl_turbo changes is the training phase; generation and reward scoring are the same for every
variant, so the training benchmarks replace them with a batch of random prompt and completion ids (no padding,
random advantages), the same for every variant at a given seed. `synthetic_inputs` is one micro-batch, driven by
hand on one GPU; `synthetic_rollouts` stands in for the trainer's generation inside `Trainer.train()`, where
FSDP2 and DeepSpeed wrap the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


def synthetic_inputs(micro_batch: int, prompt_len: int, completion_len: int, vocab_size: int, device: torch.device,
                     tis: bool, seed: int = 0, items_in_batch: int | None = None) -> dict[str, torch.Tensor]:
    """A batch like ``_generate_and_score_completions`` returns, before any old-logps pass; same for every variant.
    `items_in_batch`: the completion tokens the loss normalizes by (this batch's by default; TRL counts every
    process's generation batch)."""
    gen = torch.Generator().manual_seed(seed)
    batch: dict[str, torch.Tensor] = {
        "prompt_ids": torch.randint(vocab_size, (micro_batch, prompt_len), generator=gen),
        "prompt_mask": torch.ones(micro_batch, prompt_len, dtype=torch.long),
        "completion_ids": torch.randint(vocab_size, (micro_batch, completion_len), generator=gen),
        "completion_mask": torch.ones(micro_batch, completion_len, dtype=torch.long),
        "advantages": torch.randn(micro_batch, generator=gen),
        "num_items_in_batch": torch.tensor(items_in_batch or micro_batch * completion_len),
    }
    if tis:
        # Near a random-init model's log-probs (~ -log V); the values steer the IS ratio only, not the work done
        noise = torch.randn(micro_batch, completion_len, generator=gen)
        batch["sampling_per_token_logps"] = noise * 0.01 - math.log(vocab_size)
    return {name: tensor.to(device) for name, tensor in batch.items()}


def synthetic_rollouts(prompt_len: int, completion_len: int, vocab_size: int, device: torch.device, processes: int,
                       seed: int = 0) -> Callable[[list[Any]], dict[str, torch.Tensor]]:
    """A stand-in for the trainer's `_generate_and_score_completions`: for the local generation batch it is given
    (one row per sequence), a synthetic batch of as many sequences, another one at every call, with the loss
    normalized over every process's completion tokens as TRL normalizes it."""
    calls = [0]

    def generate_and_score(generation_batch: list[Any]) -> dict[str, torch.Tensor]:
        rows = len(generation_batch)
        calls[0] += 1
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return synthetic_inputs(rows, prompt_len, completion_len, vocab_size, device, tis=False,
                                seed=seed + 1000 * calls[0] + rank, items_in_batch=rows * completion_len * processes)

    return generate_and_score
