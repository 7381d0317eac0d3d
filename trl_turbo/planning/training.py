"""The training phase's device memory, predicted for a micro-batch shape: stock TRL's and each memory plan's.

Design decision: an activation model in units of hidden-size tensors per token, with the automatic plan's decisions
taken by the planner's own code (`offload.memory_plan.plan_layers`, the same margin, reserve and group rules), so
the forecast and the run cannot disagree on policy, only on bytes. Per token, one decoder layer (bf16) saves:
- around its attention: `NORM_STATES` hidden-size tensors per hidden-size norm (the norm's input, its fp32
  statistics, the residual branch), the query and attention output (2 x query width) and key and value;
- around its gated MLP: four intermediate-size tensors (gate, up, the activation and the product).
Linear modules stored in 4 bits save no copy of their input (bitsandbytes recomputes from the weight), which
removes one hidden state per shared input and the attention-output and MLP-product inputs.
Recomputing a checkpointed layer in the backward pass takes twice its saved activations (the activations and their
gradients), over one MLP tile only where the MLP is tiled. The automatic plan reserves one layer's plain activations
(`PLAIN_EXTRA_STATES` more) for a layer's backward. Calibrated on the Llama-3.1-8B and Gemma-2-9B bench shapes
(H200): NORM_STATES and PLAIN_EXTRA_STATES are fitted; the kept layer's count below is not.
A layer whose activations the plan keeps stores each value once (`offload.lean_activations`), counted from its
parts (`kept_layer_states`): each norm's saved input (`KEPT_NORM_STATES`), one copy of each of the three linear
inputs (attention, attention output, MLP), the query, key, value and attention output, and the MLP's gate and up.
`tests/planning` checks every committed bench row of the current code against the forecast.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import MemoryPlanMode
from ..families import LLAMA_NORM_MODEL_TYPES, POST_MLP_NORM_MODEL_TYPES
from ..grpo.sequence_groups import group_count
from ..offload.memory_plan import (
    LayerPlan,
    fastest_group_rows,
    head_bytes_per_token,
    plan_tokens,
    recompute_working_factor,
    spendable,
)
from ..offload.tiled_mlp import MLP_WORKING_TENSORS, fitting_tile_tokens
from .model_spec import ModelSpec

NORM_STATES = 2.25
# What a norm of a kept layer saves, in hidden-size tensors: a lean (Llama-style) norm its 16-bit input; another
# (gemma's `1 + weight` form) an fp32 copy of its input and its fp32 normalised value.
KEPT_NORM_STATES = {True: 1, False: 4}
KEPT_LINEAR_INPUTS = 3  # the attention's, the attention output's and the MLP's input, one copy each
# A layer's backward working set (what plain autograd stores for it: the planner reserves it) holds these more than
# `layer_states` (its input and its lean norms' fp32 output); fitted with NORM_STATES.
PLAIN_EXTRA_STATES = 4
ACTIVATION_BYTES = 2  # bf16
# Device memory outside torch's allocator (CUDA context, cuBLAS workspaces): not free for the planner.
CONTEXT_BYTES = 512 * 2**20


@dataclass(frozen=True)
class MicroBatch:
    sequences: int
    sequence_tokens: int  # prompt + completion, padded


@dataclass(frozen=True)
class TrainingForecast:
    """`peak_bytes`: the micro-step's device peak (weights, adapter and its gradients, activations; the optimizer
    states are added by the caller). `plan`: the layer plan of the steady-state forwards ("auto"); `first_plan`: of
    the first micro-batch, before any re-grouping; `group_sequences`: sequences per forward."""

    mode: str
    peak_bytes: int
    first_peak_bytes: int
    group_sequences: int
    groups: int
    plan: LayerPlan | None
    host_bytes: int  # offloaded checkpoints in the pinned pool


def layer_states(spec: ModelSpec, quantized_4bit: bool) -> tuple[float, float]:
    """(attention part, MLP part) of one layer's saved activations, in hidden-size tensors per token."""
    hidden = spec.hidden_size
    attention = (NORM_STATES * spec.norms_per_layer * hidden + 2 * spec.query_width + 2 * spec.key_value_width)
    mlp = 4 * spec.intermediate_size
    if quantized_4bit:
        attention -= hidden + spec.query_width
        mlp -= hidden + spec.intermediate_size
    return attention / hidden, mlp / hidden


def kept_layer_states(spec: ModelSpec) -> float:
    """One kept layer's saved activations, in hidden-size tensors per token (see the module docstring)."""
    hidden = spec.hidden_size
    norms = KEPT_NORM_STATES[spec.model_type in LLAMA_NORM_MODEL_TYPES] * spec.norms_per_layer
    attention = (2 * spec.query_width + 2 * spec.key_value_width) / hidden
    return norms + KEPT_LINEAR_INPUTS + attention + 2 * spec.intermediate_size / hidden


def token_groups(batch: MicroBatch, budget: int | None) -> tuple[int, int]:
    """(sequences per group, groups) of `grpo.sequence_groups` for a token budget (None: one forward)."""
    count = 1 if budget is None else group_count(batch.sequences, batch.sequence_tokens, budget)
    return -(-batch.sequences // count), count


def forecast_training(spec: ModelSpec, batch: MicroBatch, *, mode: str, capacity_bytes: int, static_bytes: int,
                      quantized_4bit: bool = False, forward_token_budget: int | None = 32768,
                      tiled_mlp_tokens: int | None = 16384, gradient_checkpointing: bool = True,
                      ceiling_bytes: int | None = None, sharded_reserve: int = 0,
                      head_gradient_bytes: int = 0) -> TrainingForecast:
    """The micro-step peak under `mode` ("off": stock TRL, "min", "auto") for a device of `capacity_bytes` holding
    `static_bytes` (weights and adapter) when training starts; `ceiling_bytes` caps "auto" (standby's generation
    footprint, or the user's `turbo_training_memory_gib`); `tiled_mlp_tokens` None: the MLP is not tiled;
    `sharded_reserve`: what "auto" keeps free besides its margin under FSDP2 (`memory_plan.sharded_reserve_bytes`);
    `head_gradient_bytes`: a trained LM head's weight gradient at the backward's start
    (`memory_plan.head_weight_gradient_bytes`), kept free by "auto" and in every mode's peak."""
    unit = spec.hidden_size * ACTIVATION_BYTES  # one hidden-size tensor per token
    attention, mlp = layer_states(spec, quantized_4bit)
    adapter_grads = 4 * spec.lora_parameters
    if mode == MemoryPlanMode.OFF:
        tokens = batch.sequences * batch.sequence_tokens
        if gradient_checkpointing:  # the layer inputs, then one layer's recompute, after the head's backward
            saved = spec.layers * unit * tokens
            later = max(int(2 * (attention + mlp) * unit * tokens), head_gradient_bytes)
        else:
            saved, later = int(spec.layers * (attention + mlp) * unit * tokens), head_gradient_bytes
        peak = static_bytes + adapter_grads + saved + later
        return TrainingForecast(mode, peak, peak, batch.sequences, 1, None, 0)

    rows, groups = token_groups(batch, forward_token_budget)
    tokens = rows * batch.sequence_tokens
    room = capacity_bytes - CONTEXT_BYTES - static_bytes - adapter_grads

    def frugal_peak(forward_tokens: int) -> int:
        """Every layer checkpointed and offloaded: two layer inputs in flight and one layer's recompute, its MLP over
        one tile (`offload.tiled_mlp`: finer where the device is short of memory; None: untiled)."""
        tile = forward_tokens if tiled_mlp_tokens is None else fitting_tile_tokens(
            tiled_mlp_tokens, forward_tokens, MLP_WORKING_TENSORS * spec.intermediate_size * ACTIVATION_BYTES, room)
        recompute = int(2 * (attention * forward_tokens + mlp * min(forward_tokens, tile)) * unit)
        # the head's gradient is gone (added to `.grad`) before the first recompute
        return static_bytes + adapter_grads + 2 * forward_tokens * unit + max(recompute, head_gradient_bytes)

    if mode == MemoryPlanMode.MIN:
        peak = frugal_peak(tokens)
        return TrainingForecast(mode, peak, peak, rows, groups, None, (spec.layers - 1) * tokens * unit)

    # "auto": the planner's rules (MemoryPlanner.run_first_layer) on predicted bytes
    kept_per_token = kept_layer_states(spec) * unit
    working_per_token = ((attention + mlp + PLAIN_EXTRA_STATES) * unit
                         * recompute_working_factor(spec.model_type in POST_MLP_NORM_MODEL_TYPES))
    allocated = static_bytes + adapter_grads
    under_ceiling = None if ceiling_bytes is None else ceiling_bytes - CONTEXT_BYTES - allocated
    free, margin = spendable(capacity_bytes - CONTEXT_BYTES - allocated, under_ceiling, capacity_bytes,
                             sharded_reserve + head_gradient_bytes)

    head_per_token = head_bytes_per_token(spec.hidden_size)

    def plan_for(group_tokens: int) -> LayerPlan:
        return plan_tokens(spec.layers, group_tokens, kept_per_token, working_per_token, unit, head_per_token, free,
                           allocated, margin, True)

    first_plan = plan_for(tokens)
    plan, steady_rows, steady_groups = first_plan, rows, groups
    if forward_token_budget is not None:  # later micro-batches: the groups the planner prices fastest
        steady_rows = fastest_group_rows(batch.sequences, batch.sequence_tokens, forward_token_budget, spec.layers,
                                         plan_for, sharded=sharded_reserve > 0)
        steady_rows, steady_groups = token_groups(batch, steady_rows * batch.sequence_tokens)
        plan = plan_for(steady_rows * batch.sequence_tokens)
    host = plan.offloaded * plan.input_bytes

    def peak(layer_plan: LayerPlan) -> int:
        # keeping nothing (the first layer included) is the frugal plan, its MLPs tiled: "min"'s peak and the inputs
        # it parks on the device, not the planner's reserve for a kept plan's untiled recompute
        if layer_plan.kept_layers:
            return layer_plan.predicted_peak_bytes + head_gradient_bytes
        return frugal_peak(layer_plan.tokens) + layer_plan.on_device * layer_plan.input_bytes

    return TrainingForecast("auto", peak(plan), peak(first_plan), steady_rows, steady_groups, plan, host)
