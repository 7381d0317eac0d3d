"""The memory policy of a run: which of trl_turbo's training-memory features it uses, and why the others stay off.

Design decision: one pure function of the resolved settings and the facts of the run (gradient checkpointing, the
strategy's verdict, the device type, whether Liger-Kernel can run, whether a colocated engine stands by), so the
trainer's setup (`offload.setup`) and the forecast (`trl-turbo plan`) read the same decisions.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import MemoryPlanMode, Settings, StrEnum


class CeilingSource(StrEnum):
    """What bounds the memory in which the automatic plan lets layers keep their activations."""

    DEVICE = "device"  # the whole device
    USER = "turbo_training_memory_gib"  # the user's figure
    GENERATION = "generation"  # what the last generation used (vLLM standby)


@dataclass(frozen=True)
class MemoryPolicy:
    mode: MemoryPlanMode
    liger: bool  # Liger-Kernel's RMSNorm and SwiGLU layers
    lean_norms: bool
    checkpointing: bool  # trl_turbo's checkpoint function on the decoder layers (else transformers')
    offload: bool  # checkpointed layers' inputs go to pinned host memory
    tiled_mlp_tokens: int | None  # None: MLPs untiled (the kept layers' lean gated product only, under "auto")
    planner: bool  # the automatic plan measures and plans each training forward
    ceiling: CeilingSource
    ceiling_gib: float | None  # with CeilingSource.USER
    forward_token_budget: int | None  # None: micro-batches are never split
    # the share of the optimizer's states that waits in pinned host memory between steps (0: none)
    optimizer_states_offload: float = 0.0
    why_off: tuple[str, ...] = ()  # why requested features stay off in this run


def plan_memory(settings: Settings, *, gradient_checkpointing: bool, strategy_refusal: str | None,
                cuda_device: bool, liger_enabled: bool, standby_engine: bool) -> MemoryPolicy:
    """The policy for a run with `settings`. `strategy_refusal`: why the strategy cannot run trl_turbo's checkpointing
    (None: it can); `liger_enabled`: `turbo_liger_layers` resolved; `standby_engine`: a colocated engine releases its
    KV cache while training runs."""
    mode = settings.memory_plan
    off = mode is MemoryPlanMode.OFF
    why_off = []
    wanted = settings.offload_checkpoints or settings.tiled_mlp or mode is MemoryPlanMode.AUTO
    checkpointing = not off and gradient_checkpointing and wanted
    if checkpointing and strategy_refusal is not None:
        checkpointing = False
        why_off.append(strategy_refusal)
    planner = checkpointing and mode is MemoryPlanMode.AUTO
    offload = checkpointing and settings.offload_checkpoints and cuda_device
    if checkpointing and settings.offload_checkpoints and not cuda_device:
        why_off.append("no CUDA device: checkpoints stay on the device")
    if settings.training_memory_gib is not None:
        ceiling = CeilingSource.USER
    elif standby_engine:
        ceiling = CeilingSource.GENERATION
    else:
        ceiling = CeilingSource.DEVICE
    return MemoryPolicy(
        mode=mode,
        liger=liger_enabled,
        lean_norms=not liger_enabled and settings.lean_norms and not off,
        checkpointing=checkpointing,
        offload=offload,
        tiled_mlp_tokens=settings.tiled_mlp_tokens if checkpointing and settings.tiled_mlp else None,
        planner=planner,
        ceiling=ceiling,
        ceiling_gib=settings.training_memory_gib,
        forward_token_budget=None if off else settings.forward_token_budget,
        optimizer_states_offload=settings.offload_optimizer_states,
        why_off=tuple(why_off),
    )
