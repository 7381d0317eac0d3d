"""Patched GRPOTrainer vs stock TRL: the same losses, gradients and parameters.

Two levels (see trl_turbo.testing.parity): real training steps on a tiny model, and `_compute_loss` on hand-built
batches over the full grid of TRL's loss options (vLLM IS modes included, which CPU training cannot reach).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_fused_equals_stock, make_model_stop_early

from trl_turbo.grpo import loss_step, sequence_groups, step_plan
from trl_turbo.patches import trl_trainer
from trl_turbo.testing import parity

UNTIED = {"tie_word_embeddings": False}


CONTROLLER_STATE = ("entropy_coef", "_last_world_entropy", "_entropy_window_stats")


def assert_same_loss_and_grads(trainer, inputs, *, rtol=2e-5, atol=1e-7):
    initial = {name: getattr(trainer, name) for name in CONTROLLER_STATE}
    stock_loss, stock_grads = parity.loss_and_grads(trainer, inputs, fused=False)
    after_stock = {name: getattr(trainer, name) for name in CONTROLLER_STATE}
    for name, value in initial.items():  # the adaptive entropy controller is stateful: replay from the same state
        setattr(trainer, name, value)
    turbo_loss, turbo_grads = parity.loss_and_grads(trainer, inputs, fused=True)
    for name, value in after_stock.items():
        if isinstance(value, float):
            assert math.isclose(getattr(trainer, name), value, rel_tol=1e-5), name
    torch.testing.assert_close(turbo_loss, stock_loss, rtol=rtol, atol=atol)
    assert stock_grads.keys() == turbo_grads.keys() and stock_grads
    for name, grad in stock_grads.items():
        torch.testing.assert_close(turbo_grads[name], grad, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    return stock_loss


def trl_is_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16's generation-time IS ratio, transcribed from grpo_trainer.py (the independent reference)."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = clip_min if clip_min is not None else -math.inf
    hi = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_types_and_levels(tmp_path, loss_type, level, peft):
    trainer = parity.build_trainer(
        parity.base_config_kwargs(str(tmp_path), loss_type=loss_type, importance_sampling_level=level,
                                  epsilon_high=5.0 if loss_type == "cispo" else 0.28),
        peft=peft, model_kwargs=UNTIED,
    )
    assert_same_loss_and_grads(trainer, parity.synthetic_batch(trainer, with_old_logps=True))


OPTION_CASES = {
    "kl_bias_corrected": dict(beta=0.1),
    "kl_plain": dict(beta=0.1, use_bias_correction_kl=False),
    "delta": dict(delta=1.2, epsilon_high=0.28),
    "off_policy_mask": dict(off_policy_mask_threshold=0.02),
    "top_entropy_quantile": dict(top_entropy_quantile=0.3),
    "entropy_bonus": dict(entropy_coef=0.05),
    "entropy_bonus_with_mask": dict(entropy_coef=0.05, top_entropy_quantile=0.5),
    "adaptive_entropy": dict(use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=100.0),
    "grpo_ga_normalizer": dict(loss_type="grpo", gradient_accumulation_steps=4),
    "dapo_ga_steps_per_generation": dict(gradient_accumulation_steps=4, steps_per_generation=2),
    "temperature": dict(temperature=0.7),
}


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("case", sorted(OPTION_CASES))
def test_loss_options(tmp_path, case, peft):
    trainer = parity.build_trainer(
        parity.base_config_kwargs(str(tmp_path), **OPTION_CASES[case]), peft=peft, model_kwargs=UNTIED
    )
    inputs = parity.synthetic_batch(trainer, with_old_logps=True, with_ref_logps=True, with_sampling_logps=True)
    assert_same_loss_and_grads(trainer, inputs)
    if case == "adaptive_entropy":  # the controller's state must evolve identically too
        assert trainer._last_world_entropy != float("inf")


def test_tool_mask(tmp_path):
    trainer = parity.build_trainer(parity.base_config_kwargs(str(tmp_path)), peft=True)
    inputs = parity.synthetic_batch(trainer, with_old_logps=True)
    inputs["tool_mask"] = (torch.rand(inputs["completion_mask"].shape, generator=torch.Generator().manual_seed(1))
                           > 0.3).long()
    assert_same_loss_and_grads(trainer, inputs)


def test_softcapped_architecture(tmp_path):
    trainer = parity.build_trainer(parity.base_config_kwargs(str(tmp_path)), arch="gemma2", peft=True,
                                   model_kwargs={"final_logit_softcapping": 3.0})
    assert_same_loss_and_grads(trainer, parity.synthetic_batch(trainer, with_old_logps=True))


def _vllm_trainer(tmp_path, mode, clip_min, clip_max, **config):
    trainer = parity.build_trainer(parity.base_config_kwargs(str(tmp_path), **config), peft=True)
    # CPU has no vLLM: switch on what use_vllm gates in the loss, exactly as GRPOTrainer.__init__ would.
    trainer.use_vllm = True
    trainer.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_mode = mode
    trainer.vllm_importance_sampling_clip_min = clip_min
    trainer.vllm_importance_sampling_clip_max = clip_max
    return trainer


IS_CASES = [
    ("token_truncate", None, 1.5), ("token_truncate", 0.5, 1.5), ("token_mask", 0.7, 1.3),
    ("sequence_truncate", None, 1.5), ("sequence_mask", 0.2, 3.0), ("sequence_mask", None, 1.1),
]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "vespo", "cispo"])
@pytest.mark.parametrize("mode,clip_min,clip_max", IS_CASES)
def test_vllm_importance_sampling_modes(tmp_path, mode, clip_min, clip_max, loss_type):
    if loss_type == "vespo" and mode.startswith("sequence"):
        pytest.skip("TRL rejects vespo with sequence-level IS correction")
    trainer = _vllm_trainer(tmp_path, mode, clip_min, clip_max, loss_type=loss_type,
                            epsilon_high=5.0 if loss_type == "cispo" else 0.2)
    inputs = parity.synthetic_batch(trainer, with_old_logps=True, with_sampling_logps=True)
    mask = inputs["completion_mask"]
    inputs["importance_sampling_ratio"] = trl_is_ratio(
        inputs["old_per_token_logps"], inputs["sampling_per_token_logps"], mask, mode, clip_min, clip_max
    )
    assert_same_loss_and_grads(trainer, inputs)


@pytest.mark.parametrize("mode,clip_min,clip_max", IS_CASES)
def test_reused_policy_logps_equal_stock_with_separate_old_forward(tmp_path, mode, clip_min, clip_max):
    """Turbo skips the old-logps forward and computes the IS ratio in the loss; stock computes both up front."""
    trainer = _vllm_trainer(tmp_path, mode, clip_min, clip_max)
    assert step_plan.reuses_policy_logps(trainer)
    assert not step_plan.needs_old_logps_forward(trainer)
    batch = parity.synthetic_batch(trainer, with_sampling_logps=True)
    with torch.no_grad():  # what stock TRL's extra forward computes at generation time
        old, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), batch["completion_ids"].size(1),
        )
    stock_inputs = dict(batch, old_per_token_logps=old, importance_sampling_ratio=trl_is_ratio(
        old, batch["sampling_per_token_logps"], batch["completion_mask"], mode, clip_min, clip_max))
    assert_fused_equals_stock(trainer, stock_inputs, batch)
    metrics = trainer._metrics["train"]
    assert metrics["sampling/importance_sampling_ratio/mean"], "IS metrics must still be logged"
    assert metrics["sampling/sampling_logp_difference/max"][-1] > 0
    mean, p95, most = (metrics[f"sampling/sampling_logp_difference/{k}"][-1] for k in ("mean", "p95", "max"))
    assert 0 < mean and 0 < p95 <= most


def test_reuse_rule(tmp_path):
    trainer = _vllm_trainer(tmp_path, "sequence_mask", None, 3.0)
    assert step_plan.reuses_policy_logps(trainer)
    trainer.args.turbo_reuse_policy_logps = False
    assert not step_plan.reuses_policy_logps(trainer) and step_plan.needs_old_logps_forward(trainer)
    trainer.args.turbo_reuse_policy_logps = True
    trainer.num_iterations = 2  # the policy moves between iterations: old log-probs differ, keep the forward
    assert not step_plan.reuses_policy_logps(trainer) and step_plan.needs_old_logps_forward(trainer)
    trainer.num_iterations = 1
    trainer.args.steps_per_generation = 3  # generation misaligned with optimizer steps
    assert not step_plan.reuses_policy_logps(trainer) and step_plan.needs_old_logps_forward(trainer)
    trainer.args.steps_per_generation = 1
    trainer.use_vllm = False  # no IS correction and aligned: TRL itself skips the forward
    assert not step_plan.reuses_policy_logps(trainer) and not step_plan.needs_old_logps_forward(trainer)


def test_generation_gate_is_held_off_only_during_generation():
    seen = []

    class FakeArgs:
        turbo_fused_loss = True
        turbo_reuse_policy_logps = True
        steps_per_generation = 1
        gradient_accumulation_steps = 2

    class FakeTrainer:
        args = FakeArgs()
        num_iterations = 1
        use_vllm = True
        vllm_importance_sampling_correction = True

    def fake_original(self, inputs):
        seen.append(self.vllm_importance_sampling_correction)
        if inputs == "boom":
            raise RuntimeError("generation failed")
        return {"ok": True}

    wrapped = trl_trainer._wrap_generate_and_score(fake_original)
    trainer = FakeTrainer()
    assert wrapped(trainer, []) == {"ok": True}
    with pytest.raises(RuntimeError):
        wrapped(trainer, "boom")
    assert seen == [False, False]
    assert trainer.vllm_importance_sampling_correction is True


def test_switches_off_is_bitwise_stock():
    stock = parity.run_training("stock", steps=2)
    off = parity.run_training("turbo", parity.ALL_FEATURES_OFF, steps=2)
    for a, b in zip(stock, off, strict=True):
        assert a.loss == b.loss
        for name in a.grads:
            assert torch.equal(a.grads[name], b.grads[name]), name
            assert torch.equal(a.params[name], b.params[name]), name


@pytest.mark.parametrize("arch,peft", [("llama", False), ("qwen2", True), ("qwen3", False), ("mistral", True),
                                       ("gemma", True)])
def test_training_steps_match_stock(arch, peft):
    stock = parity.run_training("stock", steps=3, arch=arch, peft=peft, model_kwargs=UNTIED)
    turbo = parity.run_training("turbo", steps=3, arch=arch, peft=peft, model_kwargs=UNTIED)
    parity.assert_records_close(stock, turbo, rtol=1e-4, atol=1e-6)


def test_mask_truncated_completions_training_matches_stock():
    """TRL applies mask_truncated_completions while scoring generations, so only whole training steps exercise it:
    a model made to end its completions early, with a cap some of them still reach."""
    config = {"mask_truncated_completions": True, "max_completion_length": 4}
    runs = {variant: parity.run_training(variant, config, steps=3, model_kwargs=UNTIED,
                                         prepare_model=make_model_stop_early) for variant in ("stock", "turbo")}
    parity.assert_records_close(runs["stock"], runs["turbo"], rtol=1e-4, atol=1e-6)
    clipped = [record.logs["completions/clipped_ratio"] for record in runs["stock"]]
    assert any(0 < ratio < 1 for ratio in clipped), clipped  # truncated (masked) and ended completions in one batch
    assert any(grad.abs().sum() > 0 for grad in runs["stock"][0].grads.values())


# ------------------------------------------------------------------------------------- forward token budget
GROUPED_CASES = {
    **{loss_type: {"loss_type": loss_type} for loss_type in
       ("grpo", "bnpo", "dr_grpo", "dapo", "sapo", "luspo", "vespo", "gmpo", "gppo", "reinforce")},
    "cispo": {"loss_type": "cispo", "epsilon_high": 5.0},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    "kl": {"beta": 0.1},
    "entropy_bonus": {"entropy_coef": 0.05},
    "entropy_bonus_bnpo": {"entropy_coef": 0.05, "loss_type": "bnpo"},
    "off_policy_mask_dual_clip": {"off_policy_mask_threshold": 0.02, "turbo_dual_clip": 3.0},
}


@pytest.mark.parametrize("budget", [12, 30], ids=["one-sequence-groups", "two-sequence-groups"])
@pytest.mark.parametrize("case", sorted(GROUPED_CASES))
def test_forward_token_budget_groups_equal_one_pass(tmp_path, case, budget):
    trainer = parity.build_trainer(parity.base_config_kwargs(str(tmp_path), **GROUPED_CASES[case]), peft=True,
                                   model_kwargs=UNTIED)
    trainer.model.train()
    inputs = parity.synthetic_batch(trainer, batch=4, prompt_len=5, completion_len=7, with_old_logps=True,
                                    with_ref_logps=True, with_sampling_logps=True)
    trainer.args.turbo_forward_token_budget = None
    assert sequence_groups.sequence_groups(trainer, inputs) is None
    one_loss, one_grads = parity.loss_and_grads(trainer, inputs, fused=True)
    trainer.args.turbo_forward_token_budget = budget
    assert len(sequence_groups.sequence_groups(trainer, inputs)) == (4 if budget == 12 else 2)
    grouped_loss, grouped_grads = parity.loss_and_grads(trainer, inputs, fused=True)
    torch.testing.assert_close(grouped_loss, one_loss, rtol=1e-5, atol=1e-7)
    for name, grad in one_grads.items():
        torch.testing.assert_close(grouped_grads[name], grad, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("options", [{"top_entropy_quantile": 0.5}, {"loss_type": "kl_cov"},
                                     {"use_adaptive_entropy": True, "entropy_coef": 0.01}])
def test_forward_token_budget_leaves_whole_batch_statistics_unsplit(tmp_path, options):
    trainer = parity.build_trainer(parity.base_config_kwargs(str(tmp_path), turbo_forward_token_budget=12,
                                                             **options), peft=True)
    trainer.model.train()
    inputs = parity.synthetic_batch(trainer, batch=4, prompt_len=5, completion_len=7)
    assert sequence_groups.sequence_groups(trainer, inputs) is None


def test_forward_token_budget_leaves_image_inputs_unsplit(tmp_path):
    """Image inputs are laid out per image, patch or tile, not per sequence: slicing them by sequence rows would
    hand a group another group's images, so a micro-batch with them is one forward."""
    trainer = parity.build_trainer(parity.base_config_kwargs(str(tmp_path), turbo_forward_token_budget=12),
                                   peft=True)
    trainer.model.train()
    inputs = parity.synthetic_batch(trainer, batch=4, prompt_len=5, completion_len=7)
    assert len(sequence_groups.sequence_groups(trainer, inputs)) == 4
    patches = {"pixel_values": torch.zeros(10, 8), "image_grid_thw": torch.tensor([[1, 2, 3], [1, 2, 2]]),
               "num_images": [1, 1, 0, 0]}  # Qwen-VL layout: rows are patches
    assert sequence_groups.sequence_groups(trainer, {**inputs, **patches}) is None
    one_image_each = {"pixel_values": torch.zeros(4, 3, 2, 2)}  # rows happen to match the sequences
    assert sequence_groups.sequence_groups(trainer, {**inputs, **one_image_each}) is None
    assert sequence_groups.sequence_groups(trainer, {**inputs, "unknown_rows": torch.zeros(3, 2)}) is None


def test_forward_token_budget_training_matches_stock(monkeypatch):
    stock = parity.run_training("stock", steps=2, peft=True, model_kwargs=UNTIED)
    group_counts = []
    grouped = loss_step.grouped_compute_loss

    def counting(self, model, inputs, groups):
        group_counts.append(len(groups))
        return grouped(self, model, inputs, groups)

    monkeypatch.setattr(loss_step, "grouped_compute_loss", counting)
    turbo = parity.run_training("turbo", {"turbo_forward_token_budget": 20}, steps=2, peft=True,
                                model_kwargs=UNTIED)
    assert group_counts and min(group_counts) >= 2, group_counts  # TRL's real inputs were split
    parity.assert_records_close(stock, turbo, rtol=1e-4, atol=1e-6)
