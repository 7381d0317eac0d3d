"""The text `trl-turbo plan` prints: one table of phases for trl_turbo and stock TRL, the training plan, the
longest completion that fits."""

from __future__ import annotations

from typing import Any

from ..config import MemoryPlanMode, SamplingMode
from ..distributed import Strategy
from ..offload.memory_plan import describe_plan
from ..vllm.sharing import SharingMode
from .training import CONTEXT_BYTES

_GIB = 2**30


def _gib(value: int) -> str:
    return f"{value / _GIB:7.1f}"


def render(plan: Any) -> str:
    spec, turbo, stock, args = plan.spec, plan.turbo, plan.stock, plan.args
    adapter = f"{spec.lora_parameters / 1e6:.1f}M trainable (LoRA)" if spec.lora_parameters else "full fine-tuning"
    lines = [
        f"trl-turbo plan: {plan.model} ({spec.model_type}, {spec.parameters / 1e9:.2f}B parameters, "
        f"{'4-bit' if plan.quantized_4bit else '16-bit'}, {adapter})",
        f"device {turbo.capacity_bytes / _GIB:.1f} GiB, host {(turbo.host_capacity_bytes or 0) / _GIB:.1f} GiB; "
        f"micro-batch {args.per_device_train_batch_size} x ({turbo.prompt_tokens} prompt + "
        f"{turbo.completion_tokens} completion) tokens; turbo_memory_plan={turbo.plan.memory.mode.value}",
        *_decisions(turbo.plan, int(getattr(args, "world_size", 1) or 1), turbo.cast_copy),
        "",
        f"{'phase':<12}{'trl_turbo device':>18}{'host':>9}{'stock TRL device':>20}{'host':>9}   (GiB)",
    ]
    stock_phases = {phase.name: phase for phase in stock.phases}
    for phase in turbo.phases:
        other = stock_phases.get(phase.name)
        lines.append(f"{phase.name:<12}{_gib(phase.device_bytes):>18}{_gib(phase.host_bytes):>9}"
                     f"{_gib(other.device_bytes) if other else '':>20}{_gib(other.host_bytes) if other else '':>9}")
    lines.append(f"{'peak + ctx':<12}{_gib(turbo.peak_bytes):>18}{'':>9}{_gib(stock.peak_bytes):>20}"
                 f"   (largest phase + {CONTEXT_BYTES / _GIB:.1f} GiB of CUDA context)")
    lines.append(f"{'fits':<12}{_verdict(turbo):>18}{'':>9}{_verdict(stock):>20}")
    training = turbo.training
    lines.append("")
    if training.plan is not None:
        described = describe_plan(training.plan).strip().replace("first training micro-batch", "steady state")
        lines.append(f"training: {training.groups} forward(s) of {training.group_sequences} sequence(s) per "
                     f"micro-batch; {described}")
        if plan.turbo_min_peak <= turbo.peak_bytes:
            lines.append(f"the least trl_turbo needs (turbo_memory_plan='min'): {plan.turbo_min_peak / _GIB:.1f} GiB; "
                         "'auto' spends free memory on speed")
        else:  # "min" runs forwards as large as turbo_forward_token_budget allows; "auto" priced smaller groups
            lines.append(f"turbo_memory_plan='min' would need {plan.turbo_min_peak / _GIB:.1f} GiB: its forwards are "
                         "as large as turbo_forward_token_budget allows, where 'auto' runs smaller groups")
    elif training.mode == "min":
        lines.append(f"training: {training.groups} forward(s) of {training.group_sequences} sequence(s) per "
                     "micro-batch; every layer offloads its checkpoint (the most frugal plan)")
    elif not turbo.plan.memory.checkpointing and turbo.plan.memory.mode is not MemoryPlanMode.OFF:
        lines.append(f"training: {training.groups} forward(s) of {training.group_sequences} sequence(s) per "
                     "micro-batch, each under transformers' gradient checkpointing (trl_turbo's is off in this run)")
    else:
        lines.append("training: stock TRL's (turbo_memory_plan='off')")
    lines.append(f"longest completion that fits: trl_turbo {_tokens(plan.turbo_longest)}, "
                 f"stock TRL {_tokens(plan.stock_longest)}")
    context = spec.max_position_embeddings
    if context and turbo.prompt_tokens + turbo.completion_tokens > context:
        lines.append(f"note: {turbo.prompt_tokens} + {turbo.completion_tokens} tokens exceed the model's context "
                     f"({context:,})")
    for forecast in (turbo, stock):
        if forecast.error:
            lines.append(f"{forecast.variant}: {forecast.error}")
    return "\n".join(lines)


def _decisions(plan: Any, processes: int = 1, cast_copy: bool = False) -> list[str]:
    """The run plan's engine and memory decisions, as a run with this config would make them."""
    lines = []
    engine = plan.engine
    if plan.strategy is Strategy.FSDP2:
        tp = engine.tp_size if engine is not None else 1
        lines.append(f"per GPU: FSDP2 over {processes} processes, vLLM tensor-parallel size {tp}"
                     + ("; each rank's FSDP2 shards are its vLLM slices (one copy)"
                        if engine is not None and engine.sharded and not cast_copy else ""))
    if engine is not None and engine.full_finetuning:
        # (vLLM casts into copies of its own, fp8 sampling) -> what vLLM holds, what standby releases beside the KV
        held, released = {
            (True, True): ("an fp8 copy of the linear weights written from each rank's fp32 shards before each "
                           "generation, and a 16-bit copy of the rest cast into at each sync (no gather)",
                           " and the copies"),
            (True, False): ("a 16-bit copy, cast into from each rank's fp32 shards at each sync (no gather)",
                            " and the copy"),
            (False, True): ("the trained parameters themselves, its linear weights an fp8 copy of them written before "
                            "each generation", " and the fp8 copy"),
            (False, False): ("the trained parameters themselves (no sync)", ""),
        }[cast_copy, engine.sampling is SamplingMode.FP8]
        lines.append(f"vLLM: full fine-tuning, its weights {held}"
                     + (f"; KV cache{released} released while training (standby)" if engine.standby else ""))
    elif engine is not None and engine.sharing is not None:
        held = ("shared with the trainer" if engine.sharing.mode is SharingMode.SHARED
                else f"a separate 16-bit copy ({'; '.join(engine.sharing.reasons)})")
        lines.append(f"vLLM: base weights {held}; {engine.sampling.value} sampling"
                     + (f" ({'; '.join(engine.sampling_problems)})" if engine.sampling_problems else "")
                     + ("; KV cache released while training (standby)" if engine.standby else ""))
    elif engine is not None and engine.standby:
        lines.append("vLLM: its own copy of the weights; KV cache released while training (standby)")
    memory = plan.memory
    features = [name for name, on in (("Liger layers", memory.liger), ("lean norms", memory.lean_norms),
                                      ("trl_turbo's checkpointing", memory.checkpointing),
                                      ("offloaded checkpoints", memory.offload),
                                      ("tiled MLP", memory.tiled_mlp_tokens is not None)) if on]
    if memory.optimizer_states_offload:
        features.append(f"{memory.optimizer_states_offload:.0%} of the optimizer's states on the host")
    ceiling = {"device": "the whole device", "generation": "the last generation's footprint"}.get(memory.ceiling.value,
                                                                                               memory.ceiling.value)
    lines.append(f"memory: {', '.join(features) or 'stock'}; ceiling {ceiling}"
                 + (f" ({memory.ceiling_gib} GiB)" if memory.ceiling_gib is not None else "")
                 + "".join(f"; off: {why}" for why in memory.why_off))
    return lines


def _verdict(forecast: Any) -> str:
    if forecast.fits:
        return "yes"
    over = forecast.peak_bytes - forecast.capacity_bytes
    return f"NO (+{over / _GIB:.1f})" if over > 0 else "NO"


def _tokens(value: int | None) -> str:
    return "none" if value is None else f"{value:,} tokens"
