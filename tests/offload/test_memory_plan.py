"""The automatic memory plan: its decisions on faked memory budgets, the measurement it plans from, exact gradients
under every split of kept, device-checkpointed and offloaded layers, re-planning after a missed prediction, and the
GRPOConfig surface (auto by default, 'min', 'off')."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from helpers import checkpointed_grads, decoder_model, token_batch

import trl_turbo
from trl_turbo.offload import CheckpointOffloader
from trl_turbo.offload.install import CheckpointingRuntime, install_runtime, memory_planner, runtime_of
from trl_turbo.offload.memory_plan import (
    LayerPlan,
    describe_plan,
    head_weight_gradient_bytes,
    plan_forward,
    plan_layers,
    plan_metrics,
)
from trl_turbo.testing import parity
from trl_turbo.testing.models import tiny_model
from trl_turbo.testing.tokenizer import VOCAB

# A faked device's capacity whose margin is the 1 GiB floor (3% of it is less)
FAKE_CAPACITY = 32 << 30

MIB = 2**20


@pytest.fixture(autouse=True)
def _fresh_patch_state():
    yield
    trl_turbo.unpatch()
    trl_turbo.patch()


# ------------------------------------------------------------------------------------------------ the decision
def test_everything_is_kept_when_it_fits():
    plan = plan_layers(7, layer_bytes=100 * MIB, input_bytes=10 * MIB, available_bytes=10_000 * MIB,
                       can_offload=True)
    assert (plan.offloaded, plan.on_device, plan.kept) == (0, 0, 7)
    assert [plan.mode(i) for i in range(7)] == ["keep"] * 7


def test_kept_layers_then_device_checkpoints_then_offload():
    # 2 inputs in flight (20) + 3 kept layers (300) leave 45: four inputs on the device, the rest offloaded
    plan = plan_layers(10, layer_bytes=100 * MIB, input_bytes=10 * MIB, available_bytes=365 * MIB,
                       can_offload=True)
    assert (plan.offloaded, plan.on_device, plan.kept) == (3, 4, 3)
    assert [plan.mode(i) for i in range(10)] == ["offload"] * 3 + ["device"] * 4 + ["keep"] * 3


def test_without_an_offloader_the_rest_checkpoints_on_the_device():
    # 10 checkpoints (100) always; each kept layer costs 90 more: two fit in 290
    plan = plan_layers(10, layer_bytes=100 * MIB, input_bytes=10 * MIB, available_bytes=290 * MIB,
                       can_offload=False)
    assert (plan.offloaded, plan.on_device, plan.kept) == (0, 8, 2)


def test_nothing_fits_means_the_most_frugal_plan():
    for can_offload, expected in ((True, (5, 0, 0)), (False, (0, 5, 0))):
        plan = plan_layers(5, layer_bytes=100 * MIB, input_bytes=10 * MIB, available_bytes=-MIB,
                           can_offload=can_offload)
        assert (plan.offloaded, plan.on_device, plan.kept) == expected


def test_predicted_peak_counts_what_the_layers_keep():
    plan = plan_layers(10, layer_bytes=100 * MIB, input_bytes=10 * MIB, available_bytes=365 * MIB,
                       can_offload=True, allocated_bytes=1000 * MIB)
    assert plan.predicted_peak_bytes == (1000 + 300 + 40 + 20) * MIB
    table = describe_plan(dataclasses.replace(plan, spendable_bytes=0))
    assert "layers offloaded to host" in table and "predicted training peak            1.33 GiB" in table
    assert "predicted" not in describe_plan(plan)  # planned without a device budget: no budget rows


def test_metrics_log_no_prediction_where_none_was_made():
    planned = plan_layers(10, layer_bytes=100 * MIB, input_bytes=10 * MIB, available_bytes=365 * MIB,
                          can_offload=True, allocated_bytes=1000 * MIB)
    unplanned = LayerPlan(0, 0, 9, 0, 10 * MIB, -1, -1, 64)  # what a CPU forward records: no budget, no prediction
    assert "memory_plan/predicted_peak_gib" not in plan_metrics([unplanned])
    assert "memory_plan/spendable_gib" not in plan_metrics([unplanned])
    assert "memory_plan/allocated_gib" not in plan_metrics([unplanned])
    assert plan_metrics([unplanned, planned])["memory_plan/predicted_peak_gib"] == planned.predicted_peak_bytes / 2**30
    budgeted = [dataclasses.replace(planned, spendable_bytes=s * MIB) for s in (500, 300)]
    assert plan_metrics(budgeted)["memory_plan/spendable_gib"] == 300 * MIB / 2**30  # the tightest forward
    # what the forwards were planned on top of: the most torch had allocated then
    forward = plan_forward(10, 100 * MIB, 10 * MIB, 0, free_bytes=2000 * MIB, allocated_bytes=700 * MIB,
                           margin_bytes=100 * MIB, first_kept=True, can_offload=True, tokens=64,
                           working_bytes=50 * MIB)
    assert forward.allocated_bytes == 700 * MIB
    later = dataclasses.replace(forward, allocated_bytes=900 * MIB)
    assert plan_metrics([forward, later])["memory_plan/allocated_gib"] == 900 * MIB / 2**30


def test_saved_bytes_are_counted_once_per_storage_without_parameters():
    weight = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    from trl_turbo.offload.lean_activations import lean_saved_tensors

    with lean_saved_tensors({weight.untyped_storage().data_ptr()}) as counted:
        hidden = x @ weight  # saves x and the weight (excluded)
        (hidden * hidden).sum()  # saves `hidden` twice: one storage
    assert counted[0] == x.nbytes + hidden.nbytes


# ------------------------------------------------------------------------------------------- on a real model
def _model(layers=6):
    model = decoder_model(layers=layers)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _grads(model, ids):
    return checkpointed_grads(model, ids, checkpointing=False)  # enabled once, in `_model`


def _planned(free_bytes, offload=True, layers=6):
    model = _model(layers)
    planner = memory_planner(model, can_offload=offload)
    planner.budget = lambda device: (free_bytes, 0, FAKE_CAPACITY)  # a faked device: free, allocated, capacity
    runtime = CheckpointingRuntime(CheckpointOffloader(1 << 30) if offload else None, planner)
    install_runtime(model, runtime)
    return model, planner


def test_a_trained_lm_head_reserves_its_weight_gradient():
    """The fused loss accumulates the LM head's weight gradient in fp32 and returns it in 16 bits, at the backward's
    start: a full fine-tuning's planner keeps room for both, a LoRA run's (its head frozen) none."""
    model = _model()
    head = model.get_output_embeddings().weight
    planner = memory_planner(model, can_offload=True)
    assert planner.head_gradient_bytes == head.numel() * (4 + 2) == head_weight_gradient_bytes(*head.shape)
    head.requires_grad_(False)
    assert memory_planner(model, can_offload=True).head_gradient_bytes == 0
    planner.budget = lambda device: (1 << 40, 0, FAKE_CAPACITY)
    margin = planner._budget(torch.device("cpu"))[2]
    planner.head_gradient_bytes = 0
    assert margin - planner._budget(torch.device("cpu"))[2] == head.numel() * 6  # kept free besides the margin


@pytest.mark.parametrize(("free_bytes", "offload", "expected"), [
    (1 << 40, True, (0, 0, 5)),  # everything fits: no recompute anywhere
    (0, True, (5, 0, 0)),  # nothing fits: every other layer offloaded
    (0, False, (0, 5, 0)),  # nothing fits, no offloader: checkpointed on the device
    ("two", True, (2, 1, 2)),  # room for two more kept layers and one input on the device
], ids=["all-kept", "all-offloaded", "all-on-device", "mixed"])
def test_plans_follow_the_budget_and_gradients_stay_exact(free_bytes, offload, expected):
    reference_model = _model()
    loss, grads = _grads(reference_model, token_batch())  # transformers' checkpointing
    if free_bytes == "two":
        probe, probe_planner = _planned(1 << 40)
        _grads(probe, token_batch())
        measured = probe_planner.take_step_plans()[0]
        # margin floor, layer 0, its recompute, the head's four fp32 hidden states (this model is fp32), two inputs
        # in flight to the host, two kept layers and one input on the device, the gradients of every weight (this
        # model trains them all), which its backward allocates, and the LM head's weight gradient as the loss makes it
        head = 4 * measured.input_bytes
        gradients = sum(p.numel() * p.element_size() for p in probe.parameters() if p.requires_grad)
        free_bytes = ((1 << 30) + 2 * measured.layer_bytes + head + 2 * measured.input_bytes
                      + 2 * measured.layer_bytes + measured.input_bytes + gradients + probe_planner.head_gradient_bytes)
    model, planner = _planned(free_bytes, offload)
    model.load_state_dict(reference_model.state_dict())
    turbo_loss, turbo_grads = _grads(model, token_batch())
    plans = planner.take_step_plans()
    assert len(plans) == 1 and plans[0].layer_bytes > 0
    plan = plans[0]
    for got, want in zip((plan.offloaded, plan.on_device, plan.kept), expected):
        assert want is None or got == want, plan
    assert plan.layers == 5
    assert torch.equal(turbo_loss, loss)
    assert grads.keys() == turbo_grads.keys()
    for name in grads:  # kept, recomputed and offloaded layers give plain checkpointing's gradients, bit for bit
        assert torch.equal(turbo_grads[name], grads[name]), name


def test_a_missed_prediction_widens_the_reserve_of_later_plans():
    model, planner = _planned(1 << 40)
    _grads(model, token_batch())
    first = planner.take_step_plans()[0]
    assert first.kept == 5
    # the gradients the step's backward allocated, and the LM head's as the loss makes it, were reserved apart: not
    # part of the excess
    gradients = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    gradients += planner.head_gradient_bytes
    message = planner.observe_peak([first], first.predicted_peak_bytes + (1 << 40))
    assert "exceeded the prediction" in message and planner.extra_reserve_bytes == (1 << 40) - gradients
    assert planner.observe_peak([first], 0) is None  # no second warning, no re-plan without a new excess
    assert planner.observe_peak([first], first.predicted_peak_bytes + (1 << 40)) is None  # widens again, silently
    planner.extra_reserve_bytes = 1 << 40
    _grads(model, token_batch())
    assert planner.take_step_plans()[0].kept == 0  # the widened reserve leaves no room to keep layers


def test_no_plan_without_grad_or_outside_training():
    model, planner = _planned(1 << 40)
    with torch.no_grad():
        model(token_batch())
    assert planner.take_step_plans() == []


def test_planned_layers_without_a_device_keep_everything_as_plain_autograd(monkeypatch):
    """No device to plan for: every layer keeps its activations the plain way, without saved-tensor hooks (on a CPU
    they only cost time: a GRPO step of a tiny 151K-vocabulary model took 1.10x stock's with them)."""
    from trl_turbo.offload import memory_plan

    def no_hooks(*args, **kwargs):
        raise AssertionError("saved-tensor hooks without a device budget")

    monkeypatch.setattr(memory_plan, "lean_saved_tensors", no_hooks)
    reference_loss, reference = _grads(decoder_model(layers=6), token_batch())
    model = _model()
    planner = memory_planner(model, can_offload=False)
    install_runtime(model, CheckpointingRuntime(None, planner))
    loss, grads = _grads(model, token_batch())
    plan = planner.take_step_plans()[0]
    assert plan == LayerPlan(0, 0, 5, 0, plan.input_bytes, -1, -1, tokens=2 * 24)
    assert planner.bytes_per_token is None  # nothing measured
    torch.testing.assert_close(loss, reference_loss, rtol=0, atol=0)
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------- GRPOConfig
def test_memory_plan_field_is_validated_and_defaults_to_auto(tmp_path):
    from trl import GRPOConfig

    assert GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False).turbo_memory_plan == "auto"
    with pytest.raises(ValueError, match="turbo_memory_plan='fast'"):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, turbo_memory_plan="fast")


def test_off_installs_nothing_and_auto_plans_and_logs(tmp_path):
    off = parity.build_trainer(parity.base_config_kwargs(str(tmp_path / "off"), gradient_checkpointing=True,
                                                         turbo_memory_plan="off"), peft=True)
    assert runtime_of(off.model) is None
    layers = off.model.get_base_model().model.layers
    assert not any("forward" in module.__dict__ for layer in layers for module in layer.modules())  # no lean norms
    auto = parity.build_trainer(parity.base_config_kwargs(str(tmp_path / "auto"), gradient_checkpointing=True,
                                                          max_steps=1), peft=True)
    assert runtime_of(auto.model).planner is not None
    auto.train()
    logged = next(log for log in auto.state.log_history if "memory_plan/kept_layers" in log)
    layers = len(auto.model.get_base_model().model.layers)
    assert logged["memory_plan/kept_layers"] == layers  # no CUDA device: nothing to save memory for
    assert logged["memory_plan/layer_activation_gib"] == 0  # nor anything to measure


def _fake_device_budget(free_bytes: int):
    """`prepare_model` for `parity.run_training`: the trainer's planner sees a device with `free_bytes` free."""
    def prepare(model):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        runtime_of(base).planner.budget = lambda device: (free_bytes, 0, FAKE_CAPACITY)
    return prepare


@pytest.mark.parametrize("budget", [None, 1 << 40, 0], ids=["no-device", "all-kept", "nothing-fits"])
@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_auto_plan_training_matches_stock(peft, budget):
    """Whole training steps under "auto" against stock: without a device (plain autograd), and with a faked device
    where every layer keeps its activations through the lean saved-tensor hooks, or none fits and every layer is
    recomputed (no offloader on CPU)."""
    overrides = {"gradient_checkpointing": True, "max_completion_length": 8}
    untied = {"tie_word_embeddings": False}
    stock = parity.run_training("stock", overrides, steps=2, peft=peft, model_kwargs=untied)
    turbo = parity.run_training("turbo", {**overrides, "turbo_memory_plan": "auto"}, steps=2, peft=peft,
                                model_kwargs=untied,
                                prepare_model=None if budget is None else _fake_device_budget(budget))
    parity.assert_records_close(stock, turbo, rtol=1e-4, atol=1e-6)
    kept = [record.logs["memory_plan/kept_layers"] for record in turbo]
    measured = [record.logs["memory_plan/layer_activation_gib"] for record in turbo]
    if budget is None:
        assert kept == [2, 2] and measured == [0, 0]  # plain autograd: nothing measured
    elif budget:
        assert kept == [2, 2] and all(gib > 0 for gib in measured)  # kept through the hooks, measured
    else:
        assert kept == [0, 0]


def _layer_plans(layer_count, bytes_per_token, spendable_bytes):
    """plan_for(tokens) of a planner with `spendable_bytes` and this measurement (no offloader, tiny inputs)."""
    from trl_turbo.offload.memory_plan import plan_forward

    def plan_for(tokens):
        layer = int(bytes_per_token * tokens)  # a layer's backward working set: the same bytes
        return plan_forward(layer_count, layer, 0, 0, spendable_bytes, 0, 0, True, False, tokens, layer)

    return plan_for


def test_the_fastest_group_size_is_one_forward_where_everything_fits():
    from trl_turbo.offload.memory_plan import fastest_group_rows

    plan_for = _layer_plans(32, 1000, 1 << 50)
    assert fastest_group_rows(16, 2112, None, 32, plan_for) == 16
    assert fastest_group_rows(16, 2112, 32768, 32, plan_for) == 8  # the token budget still caps groups: 2 of 8


def test_a_tight_budget_buys_smaller_groups_that_keep_more_layers():
    from trl_turbo.offload import memory_plan

    # room for every layer (and one layer's recompute) at 2 sequences of 2112 tokens, for 3 at the whole micro-batch
    spendable = 33 * 1000 * 2 * 2112
    plan_for = _layer_plans(32, 1000, spendable)
    assert plan_for(16 * 2112).kept_layers == 3 and plan_for(2 * 2112).kept_layers == 32
    rows = memory_plan.fastest_group_rows(16, 2112, None, 32, plan_for)
    assert rows == 2  # 1.09x per token without recompute beats every larger group's recompute
    costs = {r: memory_plan.plan_cost(plan_for(r * 2112), 32) for r in (16, 8, 4, 2)}
    assert costs[2] == min(costs.values()) and costs[16] > 1.3
    # with no room at all the smallest working set wins, but one sequence (2112 tokens) is below the smallest group
    # worth planning: never picked
    assert memory_plan.fastest_group_rows(16, 2112, None, 32, _layer_plans(32, 1000, 0)) == 2
    # a split is priced as it runs: 16 sequences of 1500 tokens in groups of at most 3 run as 3,3,3,3,2,2, whose
    # 2-sequence groups (3000 tokens) are under the floor; 16 in groups of 3 or 4 never comes out of it
    tight = _layer_plans(32, 1000, 33 * 1000 * 3 * 1500)
    rows = memory_plan.fastest_group_rows(16, 1500, None, 32, tight)
    assert (16 // -(-16 // rows)) * 1500 >= memory_plan.MIN_PLANNED_GROUP_TOKENS


def test_under_fsdp2_each_group_beyond_the_first_pays_its_gathers():
    """Sharded, a group is a forward and a backward that gather every layer again. 8 sequences of 4160 tokens: eight
    groups of one keep more layers and price 1.343 per token against 1.354 for four groups of two; with
    `SHARDED_GROUP_COST` for each group beyond the first (any value from 0.0021 to 0.0129 decides the same), the four
    groups win."""
    from trl_turbo.offload import memory_plan

    plan_for = _layer_plans(32, 1000, 2 * 1000 * 2 * 4160 * 4)
    cost = {rows: memory_plan.plan_cost(plan_for(rows * 4160), 32) for rows in (1, 2)}
    assert cost[1] < cost[2]
    gathers = memory_plan.SHARDED_GROUP_COST
    assert cost[1] * (1 + 7 * gathers) > cost[2] * (1 + 3 * gathers)
    assert memory_plan.fastest_group_rows(8, 4160, None, 32, plan_for) == 1
    assert memory_plan.fastest_group_rows(8, 4160, None, 32, plan_for, sharded=True) == 2


def test_a_split_that_fits_the_budget_beats_a_faster_one_that_does_not():
    """Under standby the budget is the generation's peak: larger groups price faster per token, but where even their
    most frugal plan (every layer recomputed) overruns the budget, the split into groups that fit is taken."""
    from trl_turbo.offload import memory_plan

    # 1000 bytes a token for the first layer's activations and as much for a layer's backward working set: room for
    # 2 sequences of 4160 tokens, not for 4
    spendable = 2 * 1000 * 2 * 4160 + 1
    plan_for = _layer_plans(32, 1000, spendable)
    assert plan_for(4 * 4160).available_bytes < 0 <= plan_for(2 * 4160).available_bytes
    cost = {rows: memory_plan.plan_cost(plan_for(rows * 4160), 32) for rows in (4, 2)}
    assert cost[4] < cost[2]  # the larger groups would be faster
    assert memory_plan.fastest_group_rows(8, 4160, 32768, 32, plan_for) == 2


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_a_post_mlp_norm_layer_reserves_twice_its_plain_bytes_for_its_recompute(arch):
    """Under "auto" a Gemma-2 layer's recompute runs its MLP untiled (its output feeds the post-MLP norm) and holds
    the activations and their gradients at once: the planner reserves twice what plain autograd stores for it."""
    from trl_turbo.offload import memory_plan

    ids = token_batch()
    plain = {}
    for untiled in (False, True):
        model = decoder_model(arch, layers=3)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        planner = memory_planner(model, can_offload=False)
        assert planner.untiled_recompute is (arch == "gemma2")
        planner.untiled_recompute = untiled
        planner.budget = lambda device: (1 << 40, 0, FAKE_CAPACITY)
        install_runtime(model, CheckpointingRuntime(None, planner))
        _grads(model, ids)
        plain[untiled] = planner.plain_bytes_per_token
    assert plain[True] == pytest.approx(2 * plain[False])
    assert memory_plan.recompute_working_factor(True) == 2 and memory_plan.recompute_working_factor(False) == 1


def test_the_group_cost_table_interpolates_in_log_tokens():
    from trl_turbo.offload.memory_plan import GROUP_TOKEN_COSTS, group_token_cost

    assert group_token_cost(1) == GROUP_TOKEN_COSTS[0][1] and group_token_cost(1 << 30) == 1.0
    assert group_token_cost(4096) > group_token_cost(5793) > group_token_cost(8192)
    assert group_token_cost(5793) == pytest.approx((1.10 + 1.02) / 2, abs=1e-3)  # the geometric middle


def test_the_planner_prices_groups_from_its_last_measurement(monkeypatch):
    from trl_turbo.offload import memory_plan

    monkeypatch.setattr(memory_plan, "MIN_PLANNED_GROUP_TOKENS", 1)  # this model's forwards are tiny
    model, planner = _planned(1 << 40)
    batch = token_batch()
    sequences, length = batch.shape
    assert planner.group_tokens(sequences, length, None) is None  # nothing measured yet
    _grads(model, batch)
    assert planner.group_tokens(sequences, length, None) == sequences * length  # everything was kept: one forward
    measured = planner.take_step_plans()[0]
    # room (after the margin floor) for every layer at half the forward's tokens, for a few at the whole
    head = memory_plan.HEAD_HIDDEN_STATES * 4 * measured.input_bytes // 4
    planner.last_budget = ((1 << 30) + 9 * measured.layer_bytes // 2 + head // 2, 0, 1 << 30)
    assert planner.plan_for(sequences * length).kept_layers < 6 and planner.plan_for(length).kept_layers == 6
    assert planner.group_tokens(sequences, length, None) == sequences // 2 * length


def test_a_planner_that_measured_nothing_prices_groups_from_its_prior(monkeypatch):
    """A first forward too large to keep its first layer runs frugally and measures nothing (a 70B model's first
    micro-batch under its standby ceiling); its later micro-batches are still split where that fits better, priced
    from the prior, as the forecast prices them, instead of running whole for the rest of the run."""
    from trl_turbo.offload import memory_plan

    monkeypatch.setattr(memory_plan, "MIN_PLANNED_GROUP_TOKENS", 1)
    model, planner = _planned(0)
    batch = token_batch()
    sequences, length = batch.shape
    _grads(model, batch)
    assert planner.bytes_per_token is None and planner.current.kept_layers == 0  # nothing was measured
    prior = memory_plan.PRIOR_LAYER_BYTES_PER_INPUT_BYTE * planner.input_bytes_per_token
    assert planner.plan_for(length).layer_bytes == prior * length
    assert planner.group_tokens(sequences, length, None) == length  # nothing fits: the smallest peak, one sequence
    planner.last_budget = (1 << 40, 0, 1 << 30)
    assert planner.group_tokens(sequences, length, None) == sequences * length  # room: one forward keeps it all


def test_the_runs_first_micro_batch_is_priced_before_any_forward_from_the_models_hidden_size(monkeypatch):
    """No forward has run when the run's first micro-batch is split (the old log-probs are computed without
    gradients, unplanned): its groups are priced from the budget on its device and the prior on the layer input the
    model's config gives, the same input the first forward then sees."""
    from trl_turbo.offload import memory_plan

    monkeypatch.setattr(memory_plan, "MIN_PLANNED_GROUP_TOKENS", 1)
    batch = token_batch()
    sequences, length = batch.shape
    device = torch.device("cpu")
    for free, rows in ((0, 1), (1 << 40, sequences)):  # nothing fits: one sequence a group; room: one forward
        model, planner = _planned(free)
        assert planner.hidden_size == model.config.hidden_size and planner.last_budget is None
        assert planner.group_tokens(sequences, length, None) is None  # no device: nothing to read a budget from
        assert planner.group_tokens(sequences, length, None, device) == rows * length
        priced = planner.input_bytes_per_token, planner.head_bytes_per_token
        _grads(model, batch)
        assert priced == (planner.input_bytes_per_token, planner.head_bytes_per_token)  # what the forward saw


def test_the_planner_reserves_the_gradients_a_step_has_not_allocated_yet():
    """Full fine-tuning sets every gradient to None between steps and its backward allocates them mid-plan: the
    budget keeps their bytes free until they exist."""
    model, planner = _planned(1 << 40)
    device = torch.device("cpu")
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert trainable > 0
    before = planner._budget(device)[2]
    _grads(model, token_batch())
    assert before - planner._budget(device)[2] == trainable  # after the backward they are allocated, not reserved


def test_sequence_groups_follow_the_planned_group_size():
    from types import SimpleNamespace

    from trl_turbo.grpo.sequence_groups import planned_group_tokens

    asked = []
    planner = SimpleNamespace(group_tokens=lambda *args: asked.append(args) or 9000)
    trainer = SimpleNamespace(model=SimpleNamespace(_trl_turbo_checkpointing=SimpleNamespace(planner=planner)))
    device = torch.device("cpu")
    assert planned_group_tokens(trainer, 16, 2100, 32768, device) == 9000 and asked == [(16, 2100, 32768, device)]
    assert planned_group_tokens(SimpleNamespace(model=SimpleNamespace(_trl_turbo_checkpointing=None)), 16, 100,
                                32768) is None


def test_the_first_layer_is_checkpointed_when_its_measured_cost_cannot_fit():
    reference_model = _model()
    loss, grads = _grads(reference_model, token_batch())
    model, planner = _planned(1 << 40)
    model.load_state_dict(reference_model.state_dict())
    _grads(model, token_batch())  # measures bytes per token
    assert planner.take_step_plans()[0].first_kept
    planner.budget = lambda device: (0, 0, 0)
    turbo_loss, turbo_grads = _grads(model, token_batch())
    plan = planner.take_step_plans()[0]
    assert not plan.first_kept and plan.kept_layers == 0 and plan.offloaded == 5  # from the earlier measurement
    assert torch.equal(turbo_loss, loss)
    for name in grads:
        assert torch.equal(turbo_grads[name], grads[name]), name


def test_a_first_forward_too_large_for_the_prior_runs_the_most_frugal_plan():
    from trl_turbo.offload.memory_plan import PRIOR_LAYER_BYTES_PER_INPUT_BYTE

    model, planner = _planned(0)
    _grads(model, token_batch())
    plan = planner.take_step_plans()[0]
    assert not plan.first_kept and plan.kept_layers == 0 and plan.offloaded == 5
    assert plan.layer_bytes == PRIOR_LAYER_BYTES_PER_INPUT_BYTE * plan.input_bytes
    assert planner.bytes_per_token is None  # nothing measured: the next forward decides from the prior again


# ------------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_prediction_holds_and_a_wrong_one_replans(monkeypatch):
    import trl_turbo.offload.memory_plan as memory_plan

    model = tiny_model("llama", vocab_size=len(VOCAB), hidden_size=1024, layers=8, dtype=torch.bfloat16,
                       intermediate_size=4096, num_attention_heads=8, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=False).cuda()
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    planner = memory_planner(model, can_offload=True)
    install_runtime(model, CheckpointingRuntime(CheckpointOffloader(4 << 30), planner))
    ids = torch.randint(3, len(VOCAB), (4, 2048), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def step():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # as a GRPO step's generation does before training
        torch.cuda.reset_peak_memory_stats()
        _grads(model, ids)
        torch.cuda.synchronize()
        plans = planner.take_step_plans()
        return plans[0], torch.cuda.max_memory_allocated()

    step()  # warm-up (allocator, kernels)
    honest, peak = step()
    assert honest.kept_layers == 8  # an idle GPU holds them all
    assert peak <= honest.predicted_peak_bytes, (peak, honest.predicted_peak_bytes)  # the prediction is an upper bound
    assert planner.observe_peak([honest], peak) is None

    # A ceiling with room for about half the layers (the margin, the first layer, its recompute, four more), and a
    # measurement that under-counts 4x: too many layers kept
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    margin = memory_plan.spendable(free, 0, total)[1]  # the planner's margin under a ceiling
    room = margin + 6 * honest.layer_bytes + memory_plan.HEAD_HIDDEN_STATES * 4 * honest.input_bytes // 2
    planner.ceiling = lambda: (total - free) + room
    real_counting = memory_plan.lean_saved_tensors

    @contextlib.contextmanager
    def undercounting(excluded=None):
        with real_counting(excluded) as counted:
            yield counted
        counted[0] //= 4

    monkeypatch.setattr(memory_plan, "lean_saved_tensors", undercounting)
    wrong, wrong_peak = step()
    assert wrong.kept_layers > 4
    message = planner.observe_peak([wrong], wrong_peak)
    assert message is not None and "exceeded the prediction" in message and planner.extra_reserve_bytes > 0
    monkeypatch.setattr(memory_plan, "lean_saved_tensors", real_counting)
    replanned, replanned_peak = step()
    assert replanned.kept_layers < wrong.kept_layers  # the widened reserve keeps fewer layers
    assert replanned_peak < wrong_peak


def test_the_margin_is_a_share_of_large_devices_and_at_most_a_tenth_of_small_ones():
    gib = 2**30
    from trl_turbo.offload import memory_plan

    assert memory_plan.reserve_margin(141 * gib) == int(0.03 * 141 * gib)
    assert memory_plan.reserve_margin(24 * gib) == 1 * gib  # the floor
    assert memory_plan.reserve_margin(int(4.4 * gib)) == int(0.44 * gib)  # a 5 GiB cap: a tenth, not a quarter
    assert memory_plan.reserve_margin(24 * gib, extra_reserve_bytes=gib) == 2 * gib


def test_a_ceiling_spends_up_to_itself_with_the_smaller_margin():
    from trl_turbo.offload.memory_plan import reserve_margin, spendable

    gib = 2**30
    total = 141 * gib
    assert spendable(100 * gib, None, total) == (100 * gib, reserve_margin(total))  # the device binds: 3%
    free, margin = spendable(100 * gib, 20 * gib, total)  # the ceiling binds: 1% (1.41 GiB), not 4.23
    assert free == 20 * gib and margin == int(0.01 * total)
    assert spendable(10 * gib, 20 * gib, total) == (10 * gib, reserve_margin(total))  # the device is shorter
    assert spendable(100 * gib, 20 * gib, total, extra_reserve_bytes=gib)[1] == int(0.01 * total) + gib


def test_auto_without_tiles_still_installs_the_kept_layers_mlp(tmp_path):
    from trl_turbo.offload.tiled_mlp import TiledMLPForward

    trainer = parity.build_trainer(parity.base_config_kwargs(str(tmp_path), gradient_checkpointing=True,
                                                             turbo_tiled_mlp=False), peft=True)
    mlps = [layer.mlp for layer in trainer.model.get_base_model().model.layers]
    forwards = [mlp.__dict__.get("forward") for mlp in mlps]
    assert all(isinstance(f, TiledMLPForward) and f.tile_tokens is None for f in forwards)


# ------------------------------------------------------------------------------------------------ under FSDP2
def _sharded_planner(monkeypatch, model: torch.nn.Module, layers: int):
    """A planner over `model` whose parameters read as sharded over two ranks (as FSDP2's DTensors over a shard
    group of two would)."""
    from trl_turbo.offload import memory_plan

    monkeypatch.setattr(memory_plan, "shard_group_size", lambda parameter: 2)
    return memory_plan.MemoryPlanner(layer_count=layers, parameters=model.parameters, can_offload=True)


@pytest.mark.parametrize("full_finetuning", [False, True])
def test_the_forecast_and_the_live_planner_reserve_the_same_gathered_bytes(monkeypatch, full_finetuning):
    """The forecast counts from the shape, the planner from the live parameters; they must agree. accelerate keeps
    FSDP2's trainable shards in fp32 (here: every weight under full fine-tuning, the adapter with LoRA), and both
    count them at the 16 bits FSDP2 gathers them in."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trl_turbo.planning.model_spec import model_spec
    from trl_turbo.planning.run import gathered_model_bytes
    from trl_turbo.planning.shapes import build_config

    config = build_config("tiny")
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    if full_finetuning:
        model = model.float()  # every parameter trains: accelerate upcasts its shards
        spec = model_spec(config)
    else:
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.data = parameter.data.float()  # the adapter in fp32
        spec = model_spec(config, lora_r=4)
    from trl_turbo.offload import memory_plan

    layers = spec.layers
    planner = _sharded_planner(monkeypatch, model, layers)
    live = planner._sharded_reserve()
    assert live > 0
    assert live == memory_plan.sharded_reserve_bytes(gathered_model_bytes(spec), layers)


def test_a_peak_that_fills_the_sharded_reserve_is_not_a_miss(monkeypatch):
    from trl_turbo.offload import memory_plan

    model = torch.nn.Linear(64, 64).to(torch.bfloat16)
    planner = _sharded_planner(monkeypatch, model, layers=2)
    reserve = planner._sharded_reserve()
    assert reserve == memory_plan.SHARDED_RESERVE_LAYERS * (64 * 64 + 64) * 2 // 2
    plan = LayerPlan(2, 0, 1, 0, 1 << 20, 4 << 20, 100 << 20, 1024)
    assert plan.predicted_peak_bytes == 100 << 20 and plan.kept_layers
    # gathered parameters may fill the reserve: no miss, no wider reserve
    assert planner.observe_peak([plan], (100 << 20) + reserve) is None and planner.extra_reserve_bytes == 0
    message = planner.observe_peak([plan], (100 << 20) + reserve + 4096)
    assert message is not None and planner.extra_reserve_bytes == 4096


def test_shards_that_are_whole_on_each_rank_gather_nothing_and_reserve_nothing(monkeypatch):
    """HSDP whose shard groups are single ranks (each rank a whole replica): nothing is gathered, no reserve."""
    from trl_turbo.offload import memory_plan

    monkeypatch.setattr(memory_plan, "shard_group_size", lambda parameter: 1)
    planner = memory_plan.MemoryPlanner(layer_count=2, parameters=torch.nn.Linear(8, 8).parameters,
                                        can_offload=True)
    assert planner._sharded_reserve() == 0 and planner.sharded_reserve == 0  # decided once sharded


def test_a_model_whose_config_or_embeddings_say_nothing_leaves_the_first_micro_batch_to_its_first_forward():
    from trl_turbo.offload.install import _layer_input

    class Silent(torch.nn.Module):
        def get_input_embeddings(self):
            raise NotImplementedError  # as transformers raises where it finds no embedding layer

    assert _layer_input(Silent()) == (0, 2)
    model = _model(2)
    assert _layer_input(model) == (model.config.hidden_size, 4)  # this tiny model's embeddings are fp32


def test_the_step_metrics_name_the_ceiling_the_plan_ran_under():
    import types

    from trl_turbo.grpo.step_metrics import memory_plan_values
    from trl_turbo.offload import memory_plan

    planner = memory_plan.MemoryPlanner(layer_count=2, parameters=torch.nn.Linear(8, 8).parameters,
                                        can_offload=True)
    trainer = types.SimpleNamespace(accelerator=types.SimpleNamespace(is_main_process=False))
    assert "memory_plan/ceiling_gib" not in memory_plan_values(trainer, planner, None)
    planner.ceiling = lambda: 30 * 2**30  # the last generation's footprint, or the user's budget
    assert memory_plan_values(trainer, planner, None)["memory_plan/ceiling_gib"] == 30
