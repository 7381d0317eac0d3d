"""Sequence groups: a training micro-batch over `turbo_forward_token_budget` tokens (or, with the automatic memory
plan, wherever it finds smaller forwards that keep more layers' activations faster) is forwarded and backpropagated
in groups of whole sequences, so activation memory follows one group.

Design decision: a group is a slice of the micro-batch's rows, so only inputs with one row per sequence can be split
(never image inputs, whose rows are images, patches or tiles), and only losses that are sums over sequences given
whole-batch normalizers (`splittable_loss`). With several processes every rank runs the same number of groups.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import MemoryPlanMode, Settings
from ..offload.install import runtime_of


def sequence_groups(trainer: Any, inputs: dict[str, Any]) -> list[slice] | None:
    """Split the micro-batch into groups of whole sequences of at most `turbo_forward_token_budget` tokens each (with
    the automatic memory plan: the groups it prices fastest, within that budget), when the loss allows it; None: one
    forward over the whole micro-batch.

    With several processes every rank runs the same number of groups (the largest any rank needs): each group is
    a forward and backward pass, and DDP's buffer broadcasts, ZeRO-3's and FSDP's gathers and their gradient
    reductions are collectives that every rank has to enter equally often. Ranks' completions are padded to
    different lengths, so a rank-local count could hang the run."""
    settings = Settings.of(trainer.args)
    budget = settings.forward_token_budget
    training = torch.is_grad_enabled() and trainer.model.training
    if budget is None or settings.memory_plan is MemoryPlanMode.OFF or not training or not splittable_loss(trainer):
        return None
    prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
    sequences, length = prompt_ids.size(0), prompt_ids.size(1) + completion_ids.size(1)
    budget = planned_group_tokens(trainer, sequences, length, budget, prompt_ids.device) or budget
    count = group_count(sequences, length, budget)
    if not rows_are_sequences(inputs, sequences):
        count = 0  # this micro-batch cannot be split (its rank still takes part in the agreement below)
    if trainer.accelerator.num_processes > 1:
        count = agreed_group_count(trainer.accelerator, count, prompt_ids.device)
    count = min(count, sequences)  # GRPO's micro-batches have the same number of sequences on every rank
    if count < 2:
        return None
    size, larger = divmod(sequences, count)
    bounds = [0]
    for index in range(count):
        bounds.append(bounds[-1] + size + (1 if index < larger else 0))
    return [slice(start, end) for start, end in zip(bounds, bounds[1:])]


def group_count(sequences: int, length: int, budget: int) -> int:
    """How many groups of whole sequences of `length` tokens keep each group within `budget` tokens (a sequence
    longer than the budget is a group of its own); 1: the micro-batch fits as it is."""
    if sequences * length <= budget:
        return 1
    return min(sequences, -(-sequences // max(1, budget // length)))


def planned_group_tokens(trainer: Any, sequences: int, length: int, budget: int,
                         device: torch.device | None = None) -> int | None:
    """With `turbo_memory_plan='auto'`: the group size in tokens the memory plan finds fastest for a micro-batch of
    `sequences` x `length` tokens on `device` within `budget` tokens a forward (`MemoryPlanner.group_tokens`); None
    without a plan or anything to price it from."""
    runtime = runtime_of(trainer.model)
    planner = runtime.planner if runtime is not None else None
    return planner.group_tokens(sequences, length, budget, device) if planner is not None else None


def agreed_group_count(accelerator: Any, count: int, device: torch.device) -> int:
    """The largest group count of any rank, or 0 (no split anywhere) when some rank's micro-batch cannot be split
    (count 0); one small all-gather per micro-batch, on every rank."""
    counts = accelerator.gather(torch.tensor([count], device=device))
    return 0 if int(counts.min().item()) == 0 else int(counts.max().item())


def splittable_loss(trainer: Any) -> bool:
    """Whether the loss of a micro-batch is the sum of its sequence groups' losses (given whole-batch normalizers).
    Not so for statistics over all tokens of the micro-batch (entropy quantile, Clip-/KL-Cov covariances), the
    adaptive entropy controller's once-per-step update, MoE aux losses, or DeepSpeed (one backward per step)."""
    from accelerate.utils import DistributedType

    return (
        trainer.top_entropy_quantile >= 1.0
        and trainer.loss_type not in ("clip_cov", "kl_cov")
        and not trainer.use_adaptive_entropy
        and not trainer.aux_loss_enabled
        and trainer.accelerator.distributed_type != DistributedType.DEEPSPEED
    )


# Image inputs are laid out per image, patch or tile (TRL slices them with `num_images`, grids or tile counts), so
# their rows are not sequences even where the counts happen to agree.
IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "image_position_ids",
                "spatial_shapes", "num_tiles")


def rows_are_sequences(inputs: dict[str, Any], sequences: int) -> bool:
    """Whether every batched input has one row per sequence, so a group of sequences is a slice of each (no image
    inputs; tensors of one row per sequence or scalars; lists of one item per sequence or non-lists)."""
    if any(inputs.get(name) is not None for name in IMAGE_INPUTS):
        return False
    for value in inputs.values():
        if torch.is_tensor(value) and value.dim() > 0 and value.size(0) != sequences:
            return False
        if isinstance(value, list) and len(value) != sequences:
            return False
    return True


def slice_inputs(inputs: dict[str, Any], rows: slice, sequences: int) -> dict[str, Any]:
    def take(value):
        if torch.is_tensor(value) and value.dim() > 0 and value.size(0) == sequences:
            return value[rows]
        if isinstance(value, list) and len(value) == sequences:
            return value[rows]
        return value

    return {key: take(value) for key, value in inputs.items()}
