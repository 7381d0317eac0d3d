"""The automatic memory plan (`turbo_memory_plan="auto"`): per training forward, which decoder layers keep their
activations (no recompute), which checkpoint their input on the device, and which offload it to host memory.

Design decisions:
- **Measured, not modelled.** At each training forward, the first decoder layer runs with its activations kept while
  a saved-tensor hook adds up the bytes autograd saves for it (parameters excluded). That is one layer's activation
  cost at this micro-batch's exact shape, for any family, attention kernel or adapter. The dense families' layers are
  alike, so layer 0 speaks for the others. Every new shape (GRPO pads each micro-batch to its own longest completion,
  sequence groups split it) is planned from its own measurement, except where the first layer itself would not fit:
  judged by the last measurement scaled to this shape's tokens (or, before any, a prior of 24x the layer input), it
  then runs checkpointed and the plan uses that estimate.
- **From the memory free at that moment.** The device's free memory plus torch's cached-but-unused blocks, less a
  reserve for what follows the layers (one layer's backward or recompute, sized by what plain autograd would store for
  it; the loss head and gradients of hidden states) and a
  margin, within torch's per-process memory fraction. With a colocated vLLM engine in standby, its KV cache is
  released while training runs, and training may grow back to the device memory the last generation used, never
  beyond: the plan turns the step's idle memory into speed without raising its peak. The margin guards against
  running out of memory (`MARGIN_FRACTION` of the device); under such a ceiling, which the device could exceed
  without failing, a smaller one (`CEILING_MARGIN_FRACTION`) keeps the step's peak at the generation's.
- **Kept layers store each value once** (`offload.lean_activations`): no cast copies of one input, no activation
  output or MLP product that their inputs rebuild; the measurement counts what is actually stored.
- **Smaller forwards rather than recompute.** From the same measurement and budget, the planner prices every way of
  splitting the next micro-batch into sequence groups (`grpo.sequence_groups`; whole sequences, at least
  `MIN_PLANNED_GROUP_TOKENS` a group): the layers each group size could keep, at a measured cost per token of small
  groups (`GROUP_TOKEN_COSTS`) and of recomputing a layer (`RECOMPUTE_COST`). It takes the cheapest: on a large
  device one forward keeping every layer, under a tight budget groups that keep most of them.
- **Fastest plan that fits.** Keeping a layer saves its recompute (about a third of its training compute); offloading
  costs host traffic the copies mostly hide. So: as many layers kept as fit while the rest are offloaded (or, without
  an offloader, checkpointed on the device); then as many of the rest on the device as fit; the rest offloaded. Kept
  layers are the last ones, whose activations the backward pass frees first; offloaded ones the first.
- **A layer's backward working set** is what plain autograd stores for it, as measured; where a norm follows the MLP
  (`untiled_recompute`), the recompute runs that MLP untiled under "auto" where the plan keeps a layer
  (`offload.tiled_mlp`; a plan that keeps none is the frugal one, tiles included) and holds its activations and their
  gradients at once, so twice that is reserved (Gemma-2-9B, 8 x 8448 tokens under a 30 GiB
  ceiling: 33.5 GiB measured with the plain reserve, train-gemma2-9b-20261126-102934).
- **A miss re-plans.** After each micro-step the measured peak is compared with the plan's prediction. An excess is
  added to the reserve of every later plan (a warning names it once), so the run trades speed for memory instead of
  running out of it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..device_memory import device_budget, kept_free_bytes
from ..sharding.dtensor import local_of, shard_group_size
from .lean_activations import lean_saved_tensors

_GIB = 2**30
# What stays free whatever the plan: a share of the device, at least a floor (allocator fragmentation, cuBLAS/NCCL
# workspaces, the optimizer's first-step states), the floor never more than a tenth of a small device (a 4 GiB
# fraction would otherwise keep a quarter of itself back, more than its recompute needs).
MARGIN_FRACTION = 0.03
MARGIN_FLOOR_BYTES = 1 * _GIB
# Under a ceiling below what the device could hold (standby's generation footprint, turbo_training_memory_gib), the
# margin only absorbs the prediction's error: a peak past the ceiling raises the step's peak, it does not fail, and a
# miss widens the reserve of later plans. Predictions run above the measured peak (H200, Llama-3.1-8B realistic
# e2e row 20261125-082954: 47.7 GiB predicted, 45.2 GiB measured by torch).
CEILING_MARGIN_FRACTION = 0.01
CEILING_MARGIN_FLOOR_BYTES = 256 * 2**20
# Under FSDP2 a backward pass also holds gathered layers (the one computing, the one prefetched, the all-gather buffers
# they are copied out of), and the caching allocator is left with free blocks between kept activations too small for
# the next gather. Measured on 2 x H200 (Qwen2.5-32B shape, LoRA, 8 x 8448 tokens per GPU, one layer ~0.95 GiB): a
# plan whose peak the forecast put at 130.8 GiB ran out of memory with 7.9 GiB of the device held in such blocks,
# about 8 gathered layers' worth. A sharded run's planner keeps this many layers' 16-bit bytes free besides its margin.
SHARDED_RESERVE_LAYERS = 12
# Relative time per token of a micro-batch's training forward and backward split into sequence groups of this many
# tokens, every layer keeping its activations; interpolated in log tokens, 1.0 beyond the last entry. Measured on
# an H200, Llama-3.1-8B shape, LoRA r16, 16 x 2112 tokens (train-llama-3.1-8b-20261125-132705 to -133005): one
# forward of 33792 tokens 3.092 s, groups of 8448 3.152 s, 4224 3.383 s, 2112 4.565 s. Groups below the first
# entry are never planned: per-group costs eat the recompute they save.
GROUP_TOKEN_COSTS = ((4096, 1.10), (8192, 1.02), (32768, 1.0))
MIN_PLANNED_GROUP_TOKENS = GROUP_TOKEN_COSTS[0][0]
# What recomputing every layer adds to that time (same files: "min", every layer checkpointed and offloaded,
# 4.403 s against 3.092 s).
RECOMPUTE_COST = 0.42
# Under FSDP2 each sequence group is a forward and a backward through the sharded model, its layers gathered again:
# what a group beyond the first adds to a micro-step's time besides `GROUP_TOKEN_COSTS`. Measured on 2 x H200
# (Qwen2.5-32B shape, LoRA, 8 x 8448 tokens per GPU, "min"): three groups 34.05 s, one forward 33.21 s
# (train-qwen2.5-32b-2gpu-fsdp2-20261129-134227, -134951), 2.5% of which the table prices 0.5% (groups of 22528 tokens
# on average); the profile puts the rest in NCCL's gathers and in attention.
SHARDED_GROUP_COST = 0.010
# Before any measurement, a layer's saved activations (and its backward working set) are assumed to be this many times
# its input (Llama-3.1-8B: plain autograd saves 24.6x, a kept layer 14.5x). A first forward too large for that runs
# the most frugal plan instead of measuring (a 524K-token forward would keep 90 GiB).
PRIOR_LAYER_BYTES_PER_INPUT_BYTE = 24
# fp32 hidden-state-sized tensors alive after the layers: the final norm's input and output, the fused loss's gradient
# of the hidden states, and the layers' output gradient in flight.
HEAD_HIDDEN_STATES = 4


def head_bytes_per_token(hidden_size: int) -> int:
    """What follows the layers per token: `HEAD_HIDDEN_STATES` fp32 tensors of the hidden size."""
    return HEAD_HIDDEN_STATES * hidden_size * 4


def head_weight_gradient_bytes(vocab_size: int, hidden_size: int, element_size: int = 2) -> int:
    """A trained LM head's weight gradient at the backward's start, where the peak is: the fused loss (trl_turbo's
    and TRL's alike) accumulates it in fp32 over the micro-batch's tokens and returns it in the weight's dtype, and
    both exist until autograd adds it to `.grad` (full fine-tuning; a LoRA run's head is frozen: nothing)."""
    return vocab_size * hidden_size * (4 + element_size)


@dataclass(frozen=True)
class LayerPlan:
    """How the checkpointed decoder layers of one forward run, in layer order: the first `offloaded` layers offload
    their input, the next `on_device` checkpoint it on the device, the last `kept` keep their activations."""

    offloaded: int
    on_device: int
    kept: int
    layer_bytes: int  # measured activation bytes of one kept layer at this shape
    input_bytes: int  # one layer input (what a checkpoint saves)
    available_bytes: int  # what the plan could spend on the layers
    predicted_peak_bytes: int  # device memory in use at the backward pass's start, as planned
    tokens: int = 0  # tokens of the forward (rows x positions)
    spendable_bytes: int = -1  # what the whole forward could spend (free less the margin); -1: unlimited
    first_kept: bool = True  # the first layer kept its activations (and measured them)
    allocated_bytes: int = -1  # torch's allocated bytes when the forward was planned; -1: planned without a device

    @property
    def kept_layers(self) -> int:
        """Layers that kept their activations, the first one included."""
        return self.kept + self.first_kept

    @property
    def layers(self) -> int:
        return self.offloaded + self.on_device + self.kept

    def mode(self, index: int) -> str:
        """"offload", "device" or "keep" for the layer at `index`."""
        if index < self.offloaded:
            return "offload"
        return "device" if index < self.offloaded + self.on_device else "keep"


def plan_layers(layers: int, layer_bytes: int, input_bytes: int, available_bytes: int, can_offload: bool,
                allocated_bytes: int = 0) -> LayerPlan:
    """The fastest split of `layers` checkpointed layers whose activations fit in `available_bytes` (see the module
    docstring); the predicted peak is `allocated_bytes` (in use before these layers) plus what they keep. When
    nothing fits, everything is offloaded (or checkpointed on the device): the most frugal plan."""
    # What a checkpointed layer leaves on the device: its input, or (offloaded) at most two inputs in flight overall
    parked = 2 * input_bytes if can_offload else 0
    per_checkpoint = 0 if can_offload else input_bytes
    kept = 0
    gain = layer_bytes - per_checkpoint
    if gain <= 0:
        kept = layers
    else:
        spare = available_bytes - parked - layers * per_checkpoint
        kept = max(0, min(layers, spare // gain))
    rest = layers - kept
    on_device = rest
    if can_offload:
        spare = available_bytes - parked - kept * layer_bytes
        on_device = max(0, min(rest, spare // input_bytes)) if input_bytes > 0 else rest
    offloaded = rest - on_device
    used = kept * layer_bytes + on_device * input_bytes + (parked if offloaded else 0)
    return LayerPlan(offloaded=offloaded, on_device=on_device, kept=kept, layer_bytes=layer_bytes,
                     input_bytes=input_bytes, available_bytes=available_bytes,
                     predicted_peak_bytes=allocated_bytes + used)


def recompute_working_factor(untiled_recompute: bool) -> int:
    """A layer's backward working set in multiples of what plain autograd stores for it (see the module docstring)."""
    return 2 if untiled_recompute else 1


def reserve_margin(total_bytes: int, extra_reserve_bytes: int = 0) -> int:
    """What stays free of a device of `total_bytes` whatever the plan (plus what re-plans added)."""
    return kept_free_bytes(total_bytes, MARGIN_FRACTION, MARGIN_FLOOR_BYTES) + extra_reserve_bytes


def sharded_reserve_bytes(model_bytes: int, layer_count: int) -> int:
    """What a planner under FSDP2 keeps free besides its margin, for a model of `model_bytes` (whole, as gathered:
    `gathered_bytes`) over `layer_count` decoder layers (`SHARDED_RESERVE_LAYERS`)."""
    return SHARDED_RESERVE_LAYERS * (model_bytes // max(1, layer_count))


def gathered_bytes(numel: int, element_size: int) -> int:
    """A parameter's bytes as FSDP2 gathers it: in the 16-bit compute dtype of its mixed-precision policy, whatever
    its shard is stored in (accelerate keeps trainable shards in fp32)."""
    return numel * min(element_size, 2)


def spendable(free_bytes: int, free_under_ceiling: int | None, total_bytes: int,
              extra_reserve_bytes: int = 0) -> tuple[int, int]:
    """(free bytes, margin) a plan counts on: the device's free memory less `reserve_margin`, or, where a ceiling
    leaves less, the memory free under it less the ceiling's smaller margin."""
    margin = reserve_margin(total_bytes, extra_reserve_bytes)
    if free_under_ceiling is None:
        return free_bytes, margin
    ceiling_margin = kept_free_bytes(total_bytes, CEILING_MARGIN_FRACTION, CEILING_MARGIN_FLOOR_BYTES)
    ceiling_margin += extra_reserve_bytes
    if free_under_ceiling - ceiling_margin < free_bytes - margin:
        return free_under_ceiling, ceiling_margin
    return free_bytes, margin


def first_layer_fits(free_bytes: int, margin_bytes: int, head_bytes: int, estimate_bytes: int,
                     working_bytes: int) -> bool:
    """Whether the first layer may keep its activations: kept, it costs them now (`estimate_bytes`) and a layer's
    backward working set (`working_bytes`) stays reserved for the backward pass."""
    return free_bytes - margin_bytes - head_bytes - estimate_bytes - working_bytes >= 0


def plan_forward(layer_count: int, layer_bytes: int, input_bytes: int, head_bytes: int, free_bytes: int,
                 allocated_bytes: int, margin_bytes: int, first_kept: bool, can_offload: bool,
                 tokens: int, working_bytes: int) -> LayerPlan:
    """The plan of a forward's layers after the first, from the budget read before the first layer ran (what it
    keeps is spent from `free_bytes`), one kept layer's activation bytes and one layer's backward working set
    (`working_bytes`: what plain autograd stores for it, recomputed or kept)."""
    first_bytes = layer_bytes if first_kept else (0 if can_offload else input_bytes)
    working = working_bytes + head_bytes  # after the layers: one layer's backward or recompute, the head's
    available = free_bytes - first_bytes - working - margin_bytes
    return dataclasses.replace(
        plan_layers(layer_count - 1, layer_bytes, input_bytes, available, can_offload,
                    allocated_bytes=allocated_bytes + first_bytes + working),
        tokens=tokens, spendable_bytes=free_bytes - margin_bytes, first_kept=first_kept,
        allocated_bytes=allocated_bytes)


def plan_tokens(layer_count: int, tokens: int, layer_per_token: float, working_per_token: float,
                input_per_token: int, head_per_token: int, free_bytes: int, allocated_bytes: int, margin_bytes: int,
                can_offload: bool) -> LayerPlan:
    """`plan_forward` for a forward of `tokens` tokens from per-token bytes (a kept layer's, a layer's backward
    working set, a layer input, the head), its first layer kept where that fits: how the planner prices a group size
    from its last measurement, and how the forecast plans from its predictions."""
    layer, working = int(layer_per_token * tokens), int(working_per_token * tokens)
    head = head_per_token * tokens
    first_kept = first_layer_fits(free_bytes, margin_bytes, head, layer, working)
    return plan_forward(layer_count, layer, input_per_token * tokens, head, free_bytes, allocated_bytes, margin_bytes,
                        first_kept, can_offload, tokens, working)


def group_token_cost(tokens: int) -> float:
    """`GROUP_TOKEN_COSTS` at `tokens` (log-linear between entries, flat outside them)."""
    points = GROUP_TOKEN_COSTS
    if tokens <= points[0][0]:
        return points[0][1]
    for (low, low_cost), (high, high_cost) in zip(points, points[1:]):
        if tokens <= high:
            share = math.log(tokens / low) / math.log(high / low)
            return low_cost + share * (high_cost - low_cost)
    return points[-1][1]


def plan_cost(plan: LayerPlan, layer_count: int, tokens: float | None = None) -> float:
    """Modelled time per token of a forward and backward under `plan` (1.0: one large forward keeping every layer),
    its groups `tokens` long on average (default: the plan's)."""
    recomputed = layer_count - plan.kept_layers
    return group_token_cost(plan.tokens if tokens is None else tokens) * (1 + RECOMPUTE_COST * recomputed / layer_count)


def fastest_group_rows(sequences: int, length: int, max_tokens: int | None, layer_count: int,
                       plan_for: Callable[[int], LayerPlan], sharded: bool = False) -> int:
    """Sequences in the largest group of the split of a micro-batch of `sequences` x `length` tokens (forwards of at
    most `max_tokens`, None: unlimited) with the lowest `plan_cost`; `plan_for(tokens)` plans a forward of that many
    tokens. Each number of groups `grpo.sequence_groups` can run is priced as it runs: memory by its largest group,
    time by its mean one. A split whose plan fits its budget (even its most frugal plan leaves the budget whole) beats
    every split that does not, however fast: the budget is a promise (under standby, the generation's peak); among
    splits that do not fit, the smallest predicted peak wins. Splits whose smallest group is under
    `MIN_PLANNED_GROUP_TOKENS` are not considered (the fewest groups the token budget allows always are); ties go to
    fewer groups. A `sharded` model (FSDP2 over several ranks) adds `SHARDED_GROUP_COST` for each group beyond the
    first."""
    largest = sequences if max_tokens is None else max(1, min(sequences, max_tokens // length))
    fewest = -(-sequences // largest)
    best_rows, best_key = -(-sequences // fewest), (2, math.inf)
    for count in range(fewest, sequences + 1):
        rows = -(-sequences // count)
        if -(-sequences // rows) != count:
            continue  # the split runs these groups as fewer ones of the same size, priced at that count
        if count > fewest and (sequences // count) * length < MIN_PLANNED_GROUP_TOKENS:
            break
        plan = plan_for(rows * length)
        gathers = 1 + SHARDED_GROUP_COST * (count - 1) if sharded else 1.0
        key = ((0, plan_cost(plan, layer_count, sequences * length / count) * gathers) if plan.available_bytes >= 0
               else (1, float(plan.predicted_peak_bytes)))
        if _ranks_before(key, best_key):
            best_rows, best_key = rows, key
    return best_rows


def _ranks_before(key: tuple[int, float], best: tuple[int, float]) -> bool:
    """(class, value) keys: a lower class first, then a lower value; a near-tie keeps `best` (the fewer groups)."""
    return key[0] < best[0] or (key[0] == best[0] and key[1] < best[1] - 1e-9 * max(1.0, abs(best[1])))


@dataclass
class MemoryPlanner:
    """One model's planner. `parameters` returns the model's parameters (their storages are not activations; read at
    each plan, since DeepSpeed and FSDP move them when training starts). `budget` returns (free bytes, allocated
    bytes, capacity) for a device; the default reads the CUDA device (tests pass a fake). `ceiling` returns the
    device memory in use the training phase should stay under (with a colocated engine in standby: what its
    generation phase used, so planning never raises the step's peak), or None. Without a CUDA device and no fake,
    every layer keeps what plain autograd stores for it (no hooks: nothing to plan, so nothing is measured)."""

    layer_count: int
    parameters: Callable[[], Iterator[torch.Tensor]]
    can_offload: bool
    budget: Callable[[torch.device], tuple[int, int, int]] | None = None
    ceiling: Callable[[], int | None] | None = None
    extra_reserve_bytes: int = 0
    untiled_recompute: bool = False  # a post-MLP norm: a layer's recompute holds twice its plain bytes
    bytes_per_token: float | None = None  # of one kept layer, as last measured
    plain_bytes_per_token: float | None = None  # what plain autograd would store for it (a layer's working set)
    input_bytes_per_token: int = 0  # of a layer input, as last seen
    hidden_size: int = 0  # the model's, with its layer inputs' element size: priced before any forward saw one
    hidden_element_size: int = 2
    head_bytes_per_token: int = 0  # of what follows the layers (`HEAD_HIDDEN_STATES`)
    last_budget: tuple[int, int, int] | None = None  # (free, allocated, margin) read before the last forward
    current: LayerPlan | None = None
    step_plans: list[LayerPlan] = field(default_factory=list)
    warned: bool = False
    sharded_reserve: int | None = None  # `_sharded_reserve`, once the model is sharded
    head_gradient_bytes: int = 0  # `head_weight_gradient_bytes` where the LM head trains
    unborn_gradient_bytes: int = 0  # the most `_unborn_gradient_bytes` reserved since the last `observe_peak`

    def _budget(self, device: torch.device) -> tuple[int, int, int] | None:
        """(free bytes the layers may count on, bytes allocated, margin to keep), or None: no device to plan for.
        Under a ceiling: the smaller of the device's and the ceiling's budgets, each less its own margin."""
        unborn = self._unborn_gradient_bytes()
        self.unborn_gradient_bytes = max(self.unborn_gradient_bytes, unborn)
        reserve = self.extra_reserve_bytes + self._sharded_reserve() + unborn + self.head_gradient_bytes
        if self.budget is not None:
            free, allocated, total = self.budget(device)
            return free, allocated, reserve_margin(total, reserve)
        if device.type != "cuda":
            return None
        free, allocated, total = device_budget(device)
        ceiling = self.ceiling() if self.ceiling is not None else None
        under_ceiling = device_budget(device, ceiling)[0] if ceiling is not None else None
        free, margin = spendable(free, under_ceiling, total, reserve)
        return free, allocated, margin

    def _unborn_gradient_bytes(self) -> int:
        """Bytes of the gradients this step's backward will allocate and no earlier one has: every trainable
        parameter (its local shard) without a gradient yet. Large with full fine-tuning (gradients are set to None
        between steps), where they are allocated in the middle of the planned forward's backward. Under FSDP2 a
        layer gathered for the running forward holds whole 16-bit tensors whose gradients land on its shards: each
        counts as a shard of the sharded ones' size and dtype."""
        parameters = [p for p in self.parameters() if p.requires_grad and p.grad is None]
        sharded = [p for p in parameters if hasattr(p, "to_local")]
        total = sum(local_of(p).numel() * local_of(p).element_size() for p in sharded)
        gathered = [p for p in parameters if not hasattr(p, "to_local")]
        if not sharded:
            return total + sum(p.numel() * p.element_size() for p in gathered)
        group = max(shard_group_size(p) for p in sharded) or 1
        element_size = max(local_of(p).element_size() for p in sharded)
        return total + sum(-(-p.numel() // group) * element_size for p in gathered)

    def _sharded_reserve(self) -> int:
        """`sharded_reserve_bytes` when FSDP2 shards the model over more than one rank (a DTensor parameter whose
        shard group is larger than one: then layers are gathered), else 0; worked out once the model is sharded."""
        if self.sharded_reserve is None:
            parameters = list(self.parameters())
            groups = [shard_group_size(p) for p in parameters]
            if not any(groups):  # not sharded (yet: the planner may be built before FSDP2 wraps the model)
                return 0
            whole = sum(gathered_bytes(p.numel(), p.element_size()) for p in parameters)  # a DTensor's numel is whole
            self.sharded_reserve = sharded_reserve_bytes(whole, self.layer_count) if max(groups) > 1 else 0
        return self.sharded_reserve

    def run_first_layer(self, function: Callable, args: tuple[Any, ...], frugal: Callable[..., Any]) -> Any:
        """Run the first layer, plan the other layers of this forward. The first layer keeps its activations while
        their bytes are counted, unless an earlier measurement (bytes per token) says they would not fit: then it
        runs under `frugal` (its checkpoint function) and the plan uses that estimate."""
        hidden = args[0]
        budget = self._budget(hidden.device)
        tokens = hidden.numel() // hidden.shape[-1]
        input_bytes = hidden.numel() * hidden.element_size()
        head_bytes = head_bytes_per_token(hidden.shape[-1]) * tokens
        self.input_bytes_per_token = input_bytes // max(tokens, 1)
        self.head_bytes_per_token = head_bytes // max(tokens, 1)
        self.last_budget = budget
        if budget is None:  # no device to plan for: every layer keeps what plain autograd stores, no hooks
            output = function(*args)
            plan = LayerPlan(0, 0, self.layer_count - 1, 0, input_bytes, -1, -1, tokens)
            self.current = plan
            self.step_plans.append(plan)
            return output
        free, allocated, margin = budget
        layer_per_token, working_per_token = self._per_token_bytes()
        estimate, working = int(layer_per_token * tokens), int(working_per_token * tokens)
        first_kept = first_layer_fits(free, margin, head_bytes, estimate, working)
        if first_kept:
            # an FSDP2 parameter outside the gathered layer is a DTensor, whose storage is its local shard
            storages = {local_of(p).untyped_storage().data_ptr() for p in self.parameters()}
            with lean_saved_tensors(storages) as counted, kept_layer():  # also counts what plain autograd stores
                output = function(*args)
            layer_bytes, working = counted
            working *= recompute_working_factor(self.untiled_recompute)
            self.bytes_per_token, self.plain_bytes_per_token = layer_bytes / tokens, working / tokens
        else:  # an estimate only: from an earlier measurement, else the prior (then nothing else is kept either)
            output = frugal(function, *args)
            layer_bytes = estimate
        plan = plan_forward(self.layer_count, layer_bytes, input_bytes, head_bytes, free, allocated, margin,
                            first_kept, self.can_offload, tokens, working)
        self.current = plan
        self.step_plans.append(plan)
        return output

    def keeps_layers(self) -> bool:
        """Whether the current forward's plan keeps any layer: only then was its untiled recompute reserved."""
        return self.current is not None and self.current.kept_layers > 0

    def _per_token_bytes(self) -> tuple[float, float]:
        """(a kept layer's bytes, a layer's backward working set) per token: as last measured, else the prior on
        the last layer input seen."""
        prior = PRIOR_LAYER_BYTES_PER_INPUT_BYTE * self.input_bytes_per_token
        layer = self.bytes_per_token if self.bytes_per_token is not None else prior
        working = (self.plain_bytes_per_token if self.plain_bytes_per_token is not None
                   else prior * recompute_working_factor(self.untiled_recompute))
        return layer, working

    def plan_for(self, tokens: int) -> LayerPlan:
        """The plan a forward of `tokens` tokens would get from the last budget and measurement (before any
        measurement: the prior, as the first layer's plan uses it)."""
        free, allocated, margin = self.last_budget
        layer_per_token, working_per_token = self._per_token_bytes()
        return plan_tokens(self.layer_count, tokens, layer_per_token, working_per_token,
                           self.input_bytes_per_token, self.head_bytes_per_token, free, allocated, margin,
                           self.can_offload)

    def group_tokens(self, sequences: int, length: int, max_tokens: int | None,
                     device: torch.device | None = None) -> int | None:
        """Tokens per sequence group for a micro-batch of `sequences` x `length` tokens, forwards of at most
        `max_tokens` (`fastest_group_rows`); None where there is nothing to price it from. A forward too large to
        measure its first layer is priced from the prior, so a run whose first forward ran frugally still finds the
        split that fits its budget; so is the run's first micro-batch, from the budget on `device` now and the layer
        input the model's config gives (a 70B model's first micro-batch of 16k tokens would otherwise run whole and
        set the run's peak, 9 GiB over its later steps' on 4 x H200)."""
        if not self.input_bytes_per_token and self.hidden_size:
            self.input_bytes_per_token = self.hidden_size * self.hidden_element_size
            self.head_bytes_per_token = head_bytes_per_token(self.hidden_size)
        if self.last_budget is None and device is not None:
            self.last_budget = self._budget(device)
        if self.last_budget is None or not self.input_bytes_per_token:
            return None
        return length * fastest_group_rows(sequences, length, max_tokens, self.layer_count, self.plan_for,
                                           sharded=self._sharded_reserve() > 0)

    def mode(self, index: int) -> str:
        """How the layer at `index` >= 1 runs in the current forward (the first layer runs in `run_first_layer`);
        before any plan, the most frugal way."""
        if self.current is None:
            return "offload" if self.can_offload else "device"
        return self.current.mode(index - 1)

    def observe_peak(self, plans: list[LayerPlan], peak_bytes: int) -> str | None:
        """After a micro-step: compare the measured device peak with the largest prediction of its `plans` (plus the
        sharded reserve, which gathered parameters may fill, and the gradients reserved apart); on a miss, widen the
        reserve of later plans by the excess. Returns a message the first time (None otherwise)."""
        unborn, self.unborn_gradient_bytes = self.unborn_gradient_bytes, 0
        predicted = max((p.predicted_peak_bytes for p in plans if p.predicted_peak_bytes >= 0), default=-1)
        if predicted < 0 or not any(p.kept_layers for p in plans):
            return None
        # under FSDP2 the peak also holds the gathered layers and root parameters the sharded reserve keeps room
        # for, and the step's backward allocated the gradients and the LM head's gradient reserved apart: not a miss
        # of the activations' plan
        excess = peak_bytes - predicted - (self.sharded_reserve or 0) - unborn - self.head_gradient_bytes
        if excess <= 0:
            return None
        self.extra_reserve_bytes += excess
        if self.warned:
            return None
        self.warned = True
        return (f"trl_turbo memory plan: the training peak ({peak_bytes / _GIB:.2f} GiB) exceeded the prediction "
                f"({predicted / _GIB:.2f} GiB); later micro-batches are planned with {excess / _GIB:.2f} GiB more "
                "reserve (fewer layers keep their activations).")

    def take_step_plans(self) -> list[LayerPlan]:
        """The plans of the forwards since the last call (the micro-step's)."""
        plans, self.step_plans = self.step_plans, []
        return plans


def plan_metrics(plans: list[LayerPlan]) -> dict[str, float]:
    """One micro-step's plans (one per forward) as metrics: mean layer counts, largest measurement and prediction,
    the least a forward could spend (free less the margin, under any ceiling: what decided how much was kept), and
    the most torch had allocated when a forward was planned (what the prediction builds on). Plans made without a
    device budget (on CPU) predict no peak (-1): then none of the last three is logged."""
    count = max(len(plans), 1)
    metrics = {
        "memory_plan/kept_layers": sum(p.kept_layers for p in plans) / count,
        "memory_plan/device_layers": sum(p.on_device for p in plans) / count,
        "memory_plan/offloaded_layers": sum(p.offloaded for p in plans) / count,
        "memory_plan/layer_activation_gib": max((p.layer_bytes for p in plans), default=0) / _GIB,
    }
    predicted = [p.predicted_peak_bytes for p in plans if p.predicted_peak_bytes >= 0]
    if predicted:
        metrics["memory_plan/predicted_peak_gib"] = max(predicted) / _GIB
    spendable = [p.spendable_bytes for p in plans if p.spendable_bytes >= 0 and p.predicted_peak_bytes >= 0]
    if spendable:
        metrics["memory_plan/spendable_gib"] = min(spendable) / _GIB
    allocated = [p.allocated_bytes for p in plans if p.allocated_bytes >= 0 and p.predicted_peak_bytes >= 0]
    if allocated:
        metrics["memory_plan/allocated_gib"] = max(allocated) / _GIB
    return metrics


def describe_plan(plan: LayerPlan) -> str:
    """The plan as a small table (printed once per run)."""
    rows = [("layers keeping activations", f"{plan.kept_layers}"),
            ("layers checkpointed on the device", f"{plan.on_device}"),
            ("layers offloaded to host", f"{plan.offloaded}"),
            ("activations of one kept layer", f"{plan.layer_bytes / _GIB:.3f} GiB"),
            ("one layer input", f"{plan.input_bytes / _GIB:.3f} GiB")]
    if plan.spendable_bytes >= 0:  # planned against a device budget
        rows += [("memory the layers could use", f"{max(plan.available_bytes, 0) / _GIB:.2f} GiB"),
                 ("predicted training peak", f"{plan.predicted_peak_bytes / _GIB:.2f} GiB")]
    width = max(len(name) for name, _ in rows)
    return "\n".join(["trl_turbo memory plan (turbo_memory_plan='auto'), first training micro-batch:"]
                     + [f"  {name:<{width}}  {value}" for name, value in rows])


_keeping: contextvars.ContextVar[bool] = contextvars.ContextVar("trl_turbo_kept_layer", default=False)


@contextlib.contextmanager
def kept_layer() -> Iterator[None]:
    """Inside: a decoder layer runs with its activations kept, so its MLP runs untiled (tiling would recompute)."""
    token = _keeping.set(True)
    try:
        yield
    finally:
        _keeping.reset(token)


def in_kept_layer() -> bool:
    """True while a decoder layer runs with its activations kept (see `kept_layer`)."""
    return _keeping.get()


def planned_checkpoint(planner: MemoryPlanner, index: int, offloaded: Callable[..., Any],
                       on_device: Callable[..., Any]) -> Callable[..., Any]:
    """The `_gradient_checkpointing_func` of the decoder layer at `index` under `planner`: layer 0 measures and plans
    each training forward; every layer then runs as the plan says (`offloaded`/`on_device`: its checkpoint
    functions)."""

    def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or not args or not torch.is_tensor(args[0]):
            return function(*args)
        if index == 0:
            return planner.run_first_layer(function, args, offloaded if planner.can_offload else on_device)
        mode = planner.mode(index)
        if mode == "keep":
            if planner.last_budget is None:  # no device: plain autograd (see `run_first_layer`)
                return function(*args)
            with lean_saved_tensors(), kept_layer():
                return function(*args)
        return (offloaded if mode == "offload" else on_device)(function, *args, **kwargs)

    checkpoint.__trl_turbo_offloader__ = getattr(offloaded, "__trl_turbo_offloader__", None)
    return checkpoint
