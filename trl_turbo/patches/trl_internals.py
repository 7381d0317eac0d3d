"""The GRPOTrainer internals that trl_turbo's benchmark and test harnesses drive, named in this one place.

Design: the harnesses measure and compare exactly what TRL computes (its log-prob pass, its loss step, its generation
call), so they call the private methods TRL's own training loop calls. Naming them only here, beside the seams that
patch them, means a TRL rename breaks one module instead of every harness. Nothing here patches anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def per_token_logps(trainer: Any, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    logits_to_keep: int, **kwargs: Any) -> torch.Tensor:
    """The completion tokens' log-probs, as TRL computes them for the old and reference policies."""
    logps, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                             **kwargs)
    return logps


def compute_loss(trainer: Any, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """One micro-batch's GRPO loss, as `GRPOTrainer.compute_loss` computes it (trl_turbo's when patched)."""
    return trainer._compute_loss(model, inputs)


def replace_generation(trainer: Any, generate: Callable[..., Any]) -> None:
    """Have this trainer (one instance, which the caller owns) produce completions with `generate`, which takes and
    returns what TRL's `_generate_single_turn` does."""
    trainer._generate_single_turn = generate
