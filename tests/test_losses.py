"""trl_turbo's own loss types and IS modes, against hand-computed numbers, the fused kernel, and TRL's own GMPOTrainer.

Design: the hand-computed cases call `losses.grpo_loss` on leaf [B, T] log-prob tensors whose expected loss and
d(loss)/d(logp) are written out below (derivations in the comments), so a sign or normaliser error shows up as a
number, not as a drift between two implementations. The kernel cases run the same variants with log-probs from
`fused_logprobs` and from `reference_logprobs` and compare losses and hidden-state gradients. Config-time errors and
the IS diagnostics are covered here too; learning checks live in test_learning_variants.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_fused_equals_stock

import trl_turbo  # noqa: F401  (injects the turbo_* fields into GRPOConfig)
from trl_turbo import losses
from trl_turbo.grpo import step_plan
from trl_turbo.ops import fused_logprobs, reference_logprobs
from trl_turbo.patches import trl_trainer
from trl_turbo.testing import parity
from trl_turbo.testing.tolerance import assert_within_naive_error

# A 2×2 batch: row 0 has A = +1, row 1 has A = −1; N = 4 valid tokens; global_token_mean divides by N.
LOGPS = [[-1.0, -2.0], [-0.5, -1.0]]
ADVANTAGES = [1.0, -1.0]


def run(loss_type: str, ratios: list[list[float]], *, mask=None, seed: int = 0, **spec_fields):
    """Loss and d(loss)/d(logp) with old log-probs set so that exp(logp − old) equals `ratios`."""
    logps = torch.tensor(LOGPS, dtype=torch.float64, requires_grad=True)
    old = logps.detach() - torch.tensor(ratios, dtype=torch.float64).log()
    mask = torch.ones(2, 2, dtype=torch.float64) if mask is None else torch.tensor(mask, dtype=torch.float64)
    spec = losses.LossSpec(loss_type=loss_type, **spec_fields)
    batch = losses.LossInputs(
        per_token_logps=logps, mask=mask, advantages=torch.tensor(ADVANTAGES, dtype=torch.float64),
        old_per_token_logps=old, seed=seed,
    )
    out = losses.grpo_loss(spec, batch, losses.Normalizers(num_items_in_batch=mask.sum()))
    out.loss.backward()
    return out, logps.grad


def close(actual, expected) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float64), rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------------------------- hand-computed examples
def test_reinforce_hand_computed():
    # per-token loss −A·logp = [[1, 2], [−0.5, −1]] → sum 1.5 / 4; the ratio plays no part; d/dlogp = −A / 4
    out, grad = run("reinforce", [[1.5, 0.5], [1.1, 0.7]])
    close(out.loss, 1.5 / 4)
    close(grad, [[-0.25, -0.25], [0.25, 0.25]])


RATIOS = [[1.5, 0.5], [1.1, 0.7]]


def test_dapo_reference_point_hand_computed():
    # PPO clip at [0.8, 1.2]: (0,0) A>0 r=1.5 → 1.2 (clipped, no grad); (0,1) r=0.5 unclipped; (1,0) A<0 r=1.1
    # unclipped; (1,1) A<0 r=0.7 → 0.8 (clipped, no grad). loss = (−1.2 − 0.5 + 1.1 + 0.8) / 4
    out, grad = run("dapo", RATIOS)
    close(out.loss, 0.2 / 4)
    close(grad, [[0.0, -0.5 / 4], [1.1 / 4, 0.0]])


def test_gppo_hand_computed():
    # Same values as dapo, but clipped tokens keep the gradient clip(r)·A·∇log r: (0,0) −1.2/4, (1,1) +0.8/4
    out, grad = run("gppo", RATIOS)
    close(out.loss, 0.2 / 4)
    close(grad, [[-1.2 / 4, -0.5 / 4], [1.1 / 4, 0.8 / 4]])


def test_dual_clip_hand_computed():
    # A<0 tokens with r = 4 and 2 (row 1), c = 3: −min(−r, −1.2) = r, bounded by c·|A| = 3 → loss 3 (no grad) and
    # 2 (grad −A·r = 2). Row 0 (A>0) is untouched by dual-clip: r = 1.5 → 1.2 (no grad), r = 1 → grad −1.
    out, grad = run("dapo", [[1.5, 1.0], [4.0, 2.0]], dual_clip=3.0)
    close(out.loss, (-1.2 - 1.0 + 3.0 + 2.0) / 4)
    close(grad, [[0.0, -1.0 / 4], [0.0, 2.0 / 4]])
    assert out.dual_clipped.tolist() == [[False, False], [True, False]]
    without, _ = run("dapo", [[1.5, 1.0], [4.0, 2.0]])
    close(without.loss, (-1.2 - 1.0 + 4.0 + 2.0) / 4)


def test_gmpo_hand_computed():
    # ε = 0.4 in log space. Row 0 (A>0): log r = [log 1.5, log 0.5] → min(lr, clamp(lr)) = [0.4 (clipped), log 0.5];
    # row 1 (A<0): [log 1.1, log 0.7] inside the range. w_i = exp(mean of clipped log-ratios); loss = mean_i(−w_i·A_i).
    out, grad = run("gmpo", RATIOS, epsilon_low=0.4, epsilon_high=0.4)
    w0 = math.exp((0.4 + math.log(0.5)) / 2)
    w1 = math.exp((math.log(1.1) + math.log(0.7)) / 2)
    close(out.loss, (-w0 + w1) / 2)
    # d/dlogp_t = −A·w·(1/|o|)·(1/B) on tokens whose log-ratio is not clipped
    close(grad, [[0.0, -w0 / 4], [w1 / 4, w1 / 4]])


def test_clip_cov_hand_computed():
    # On-policy (r = 1, nothing clipped). cov = (A − mean A)(logp − mean logp), mean A = 0, mean logp = −1.125:
    # [[0.125, −0.875], [−0.625, −0.125]]. With (lb, ub) = (0.1, 5) only token (0,0) is a candidate, and
    # max(1, ⌊0.25·4⌋) = 1 token is detached: its loss and gradient are 0; the rest is −A·r / 4.
    out, grad = run("clip_cov", [[1.0, 1.0], [1.0, 1.0]], clip_cov_ratio=0.25, clip_cov_lb=0.1, clip_cov_ub=5.0)
    close(out.loss, (0.0 - 1.0 + 1.0 + 1.0) / 4)
    close(grad, [[0.0, -0.25], [0.25, 0.25]])
    assert out.cov_selected.tolist() == [[True, False], [False, False]]


def test_kl_cov_hand_computed():
    # Top max(1, ⌊0.25·4⌋) = 1 token by covariance: (0,0) (cov 0.125). Its loss −r·A + coef·|log r| with r = 1.5,
    # coef = 0.5 → −1.5 + 0.5·log 1.5, gradient −A·r + coef·sign(log r) = −1.5 + 0.5. Other tokens: −r·A, r = 1.
    out, grad = run("kl_cov", [[1.5, 1.0], [1.0, 1.0]], kl_cov_ratio=0.25, kl_cov_coef=0.5)
    close(out.loss, (-1.5 + 0.5 * math.log(1.5) - 1.0 + 1.0 + 1.0) / 4)
    close(grad, [[-1.0 / 4, -0.25], [0.25, 0.25]])
    assert out.cov_selected.tolist() == [[True, False], [False, False]]


def test_clip_cov_selection_is_seeded_and_sized():
    gen = torch.Generator().manual_seed(0)
    logps = torch.randn(8, 64, generator=gen)
    advantages = torch.randn(8, 1, generator=gen)
    mask = torch.ones(8, 64)
    clipped = torch.zeros(8, 64, dtype=torch.bool)

    def select(seed: int) -> torch.Tensor:
        return losses.clip_cov_selection(logps, advantages, mask, clipped, 0.02, 0.1, 5.0, seed)

    assert torch.equal(select(3), select(3))
    assert not torch.equal(select(3), select(4))
    assert int(select(3).sum()) == int(0.02 * 512)
    cov = (advantages - advantages.mean()) * (logps - logps.mean())
    assert bool(((cov[select(3)] > 0.1) & (cov[select(3)] < 5.0)).all())


# --------------------------------------------------------------------------------------------------- IS modes
def test_geometric_is_modes_hand_computed():
    # Row 0: token log-ratios (trainer − sampler) [0.2, −0.6]; row 1: [0.3, pad]. Geometric: exp(mean) over valid
    # tokens = [exp(−0.2), exp(0.3)]; TRL's sequence modes: exp(sum) = [exp(−0.4), exp(0.3)].
    trainer = torch.tensor([[-1.0, -2.0], [-0.5, -9.0]], dtype=torch.float64)
    sampler = trainer - torch.tensor([[0.2, -0.6], [0.3, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    raw = losses.raw_importance_sampling_ratio(trainer, sampler, mask, "sequence_geometric_mask")
    close(raw, [[math.exp(-0.2)], [math.exp(0.3)]])
    close(losses.raw_importance_sampling_ratio(trainer, sampler, mask, "sequence_mask"),
          [[math.exp(-0.4)], [math.exp(0.3)]])
    truncated = losses.vllm_importance_sampling_ratio(trainer, sampler, mask, "sequence_geometric_truncate", None, 1.2)
    close(truncated, [[math.exp(-0.2)], [1.2]])
    masked = losses.vllm_importance_sampling_ratio(trainer, sampler, mask, "sequence_geometric_mask", 0.9, 1.2)
    close(masked, [[0.0], [0.0]])  # exp(−0.2) = 0.819 < 0.9, exp(0.3) = 1.35 > 1.2

    stats = losses.importance_sampling_diagnostics(trainer, sampler, mask, "sequence_geometric_mask", 0.5, 1.2)
    token_ratios = sorted([math.exp(0.2), math.exp(-0.6), math.exp(0.3)])
    close(stats["raw_importance_sampling_ratio/mean"], sum(token_ratios) / 3)
    close(stats["raw_importance_sampling_ratio/min"], token_ratios[0])
    close(stats["raw_importance_sampling_ratio/max"], token_ratios[-1])
    close(stats["raw_importance_sampling_ratio/p95"], token_ratios[-1])
    close(stats["raw_sequence_importance_sampling_ratio/min"], math.exp(-0.4))
    close(stats["raw_geometric_sequence_importance_sampling_ratio/max"], math.exp(0.3))
    close(stats["is_masked_fraction"], 0.5)  # one of two sequences outside [0.5, 1.2]
    k3 = [math.exp(x) - x - 1 for x in (0.2, -0.6, 0.3)]
    close(stats["sampler_trainer_kl"], sum(k3) / 3)
    truncate_stats = losses.importance_sampling_diagnostics(trainer, sampler, mask, "token_truncate", None, 1.2)
    close(truncate_stats["is_truncated_fraction"], 2 / 3)  # tokens exp(0.2) = 1.22 and exp(0.3) = 1.35 > 1.2


def _geometric_is_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """The geometric sequence ratio written out here, not through `trl_turbo.losses`: exp of the mean token
    log-ratio over each sequence's valid tokens, (B, 1), truncated or masked to [clip_min, clip_max]."""
    mean_log_ratio = ((old - sampling) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
    ratio = torch.exp(mean_log_ratio)
    if mode.endswith("truncate"):
        return ratio.clamp(min=clip_min, max=clip_max)
    return torch.where((ratio < clip_min) | (ratio > clip_max), torch.zeros_like(ratio), ratio)


@pytest.mark.parametrize("mode", losses.TURBO_IS_MODES)
def test_geometric_is_mode_in_the_patched_loss(tmp_path, mode):
    """The loss computes the geometric ratio itself (TRL never sees the mode) and logs the raw diagnostics."""
    trainer = parity.build_trainer(parity.base_config_kwargs(str(tmp_path)), peft=True)
    trainer.use_vllm = True  # CPU has no vLLM: switch on what use_vllm gates, as GRPOTrainer.__init__ would
    trainer.vllm_importance_sampling_mode = mode
    trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max = 0.5, 1.5
    assert step_plan.holds_is_gate(trainer)
    trainer.args.steps_per_generation = 3  # misaligned: TRL still runs its old-logps forward for its own reason
    assert step_plan.holds_is_gate(trainer) and step_plan.needs_old_logps_forward(trainer)
    trainer.args.steps_per_generation = 1
    inputs = parity.synthetic_batch(trainer, with_old_logps=True, with_sampling_logps=True)
    mask = inputs["completion_mask"]
    expected_ratio = _geometric_is_ratio(inputs["old_per_token_logps"], inputs["sampling_per_token_logps"], mask,
                                         mode, 0.5, 1.5)
    # Stock TRL's loss given the ratio from outside equals trl_turbo's loss computing it from old log-probs
    assert_fused_equals_stock(trainer, dict(inputs, importance_sampling_ratio=expected_ratio), inputs)
    metrics = trainer._metrics["train"]
    for name in ("raw_importance_sampling_ratio/p95", "raw_geometric_sequence_importance_sampling_ratio/mean",
                 "sampler_trainer_kl", "is_truncated_fraction" if mode.endswith("truncate") else "is_masked_fraction"):
        assert metrics[f"sampling/{name}"], name
    assert metrics["sampling/importance_sampling_ratio/mean"]


# ------------------------------------------------------------------------------------------- kernel vs reference
VARIANTS = {
    "gmpo": dict(loss_type="gmpo", epsilon_low=0.4, epsilon_high=0.4),
    "clip_cov": dict(loss_type="clip_cov", clip_cov_ratio=0.05, clip_cov_lb=0.0, clip_cov_ub=5.0),
    "kl_cov": dict(loss_type="kl_cov", kl_cov_ratio=0.05),
    "gppo": dict(loss_type="gppo"),
    "reinforce": dict(loss_type="reinforce"),
    "dapo_dual_clip": dict(loss_type="dapo", dual_clip=1.5),
    "grpo_dual_clip_kl": dict(loss_type="grpo", dual_clip=1.5, beta=0.1),
    "gmpo_kl": dict(loss_type="gmpo", beta=0.1),
    "dapo_geometric_is": dict(vllm_is_correction=True, vllm_is_mode="sequence_geometric_truncate",
                              vllm_is_clip_max=1.1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_fused_kernel_matches_reference(name, dtype):
    """Same spec, log-probs from the fused kernel vs naive full logits: equal losses and hidden gradients in fp32; in
    bf16/fp16, errors against an fp64 computation within twice the naive low-precision path's. In fp16 the loss is
    scaled by 2^12 before backward (as fp16 loss scaling does) and unscaled after."""
    gen = torch.Generator().manual_seed(0)
    batch, length, hidden_size, vocab = 4, 6, 16, 40
    hidden = torch.randn(batch, length, hidden_size, generator=gen).to(dtype)
    weight = (0.3 * torch.randn(vocab, hidden_size, generator=gen)).to(dtype)
    targets = torch.randint(0, vocab, (batch, length), generator=gen)
    mask = (torch.arange(length) < torch.tensor([[6], [4], [1], [5]])).float()
    noise = 0.4 * torch.randn(batch, length, generator=gen)
    spec = losses.LossSpec(**VARIANTS[name])
    scale = 2.0**12 if dtype == torch.float16 else 1.0

    def loss_and_grad(logprob_fn, exact=False):
        h = (hidden.double() if exact else hidden).clone().requires_grad_(True)
        logps, _ = logprob_fn(h, weight.double() if exact else weight, targets)
        detached = logps.detach().to(torch.float64 if exact else torch.float32)
        inputs = losses.LossInputs(
            per_token_logps=logps, mask=mask, advantages=torch.tensor([1.0, -0.5, 0.3, -1.2]),
            old_per_token_logps=detached + noise, ref_per_token_logps=detached - noise,
            sampling_per_token_logps=detached + noise.flip(0),
            importance_sampling_ratio=None, seed=7,
        )
        if spec.vllm_is_correction:
            inputs.importance_sampling_ratio = losses.vllm_importance_sampling_ratio(
                detached, inputs.sampling_per_token_logps, mask, spec.vllm_is_mode, None, spec.vllm_is_clip_max
            )
        out = losses.grpo_loss(spec, inputs, losses.Normalizers(num_items_in_batch=mask.sum()))
        (out.loss * scale).backward()
        return out.loss.detach(), h.grad.float() / scale

    fused_loss, fused_grad = loss_and_grad(fused_logprobs)
    naive_loss, naive_grad = loss_and_grad(reference_logprobs)
    assert torch.isfinite(fused_grad).all()
    if dtype == torch.float32:
        torch.testing.assert_close(fused_loss, naive_loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fused_grad, naive_grad, rtol=1e-5, atol=1e-6)
    else:
        exact_loss, exact_grad = loss_and_grad(reference_logprobs, exact=True)
        assert_within_naive_error(fused_loss, naive_loss, exact_loss, what="loss")
        assert_within_naive_error(fused_grad, naive_grad, exact_grad, what="hidden grad")


# ----------------------------------------------------------------------------------------- vs TRL's GMPOTrainer
@pytest.mark.parametrize("settings", [{"turbo_dual_clip": 3.0}, {"loss_type": "kl_cov", "turbo_kl_cov_coef": 0.5},
                                      {"vllm_importance_sampling_mode": "sequence_geometric_mask"}], ids=str)
def test_trainer_with_its_own_loss_refuses_turbo_loss_settings_before_loading(tmp_path, settings):
    """GMPOTrainer overrides `_compute_loss`: trl_turbo's loss settings would be ignored. The model is a path that
    does not exist, so the error must come before TRL tries to load it."""
    from trl.experimental.gmpo import GMPOConfig, GMPOTrainer

    config = GMPOConfig(output_dir=str(tmp_path), **CPU, **settings)
    with pytest.raises(ValueError, match="computes its own loss"):
        GMPOTrainer(model=str(tmp_path / "no-model"), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                    args=config)


def test_trl_trainer_with_its_own_loss_ignores_loss_type_as_stock_does(tmp_path):
    """GMPOTrainer never reads `loss_type`: stock TRL accepts any value there, and so does trl_turbo (the constructor
    goes on to load the model, which does not exist here)."""
    from trl.experimental.gmpo import GMPOConfig, GMPOTrainer

    config = GMPOConfig(output_dir=str(tmp_path), **CPU, loss_type="gmpo")
    with pytest.raises(OSError):
        GMPOTrainer(model=str(tmp_path / "no-model"), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                    args=config)


def test_user_trainer_overriding_the_loss_keeps_turbo_loss_settings(tmp_path):
    """A user's `_compute_loss` override may call trl_turbo's loss through super(): its settings are not refused (the
    constructor goes on to load the model, which does not exist here)."""
    from trl import GRPOTrainer

    class LoggingTrainer(GRPOTrainer):
        def _compute_loss(self, model, inputs):
            return super()._compute_loss(model, inputs)

    config = make(tmp_path, loss_type="kl_cov", turbo_kl_cov_coef=0.5)
    with pytest.raises(OSError):
        LoggingTrainer(model=str(tmp_path / "no-model"), args=config,
                       reward_funcs=lambda completions, **_: [0.0] * len(completions))


def test_config_subclass_with_unknown_loss_type_fails_before_loading(tmp_path):
    import dataclasses

    from trl import GRPOConfig, GRPOTrainer

    @dataclasses.dataclass
    class MyConfig(GRPOConfig):
        my_field: int = 0

    config = MyConfig(output_dir=str(tmp_path), **CPU, loss_type="dapo_typo")  # a subclass: checked at the trainer
    with pytest.raises(ValueError, match="Unknown `loss_type='dapo_typo'`"):
        GRPOTrainer(model=str(tmp_path / "no-model"), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                    args=config)

    class OwnLossTrainer(GRPOTrainer):  # computes "my_loss" in the public hook: the loss type is its own
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            raise NotImplementedError

    config = MyConfig(output_dir=str(tmp_path), **CPU, loss_type="my_loss")
    with pytest.raises(OSError):
        OwnLossTrainer(model=str(tmp_path / "no-model"), args=config,
                       reward_funcs=lambda completions, **_: [0.0] * len(completions))


@pytest.mark.parametrize("case", ["plain", "kl", "entropy_mask"])
def test_gmpo_matches_trl_gmpo_trainer(tmp_path, case):
    """loss_type='gmpo' in the patched GRPOTrainer == TRL's experimental GMPOTrainer._compute_loss (loss, grads)."""
    from trl.experimental.gmpo import GMPOConfig, GMPOTrainer

    options = {"plain": {}, "kl": {"beta": 0.1}, "entropy_mask": {"top_entropy_quantile": 0.5}}[case]
    common = dict(epsilon=0.4, **options)
    torch.manual_seed(0)
    gmpo = parity.build_trainer(parity.base_config_kwargs(str(tmp_path / "gmpo"), **common), peft=True,
                                config_cls=GMPOConfig, trainer_cls=GMPOTrainer)
    torch.manual_seed(0)
    turbo = parity.build_trainer(parity.base_config_kwargs(str(tmp_path / "turbo"), loss_type="gmpo", **common),
                                 peft=True)
    inputs = parity.synthetic_batch(turbo, with_old_logps=True, with_ref_logps=True)
    expected_loss, expected_grads = parity.loss_and_grads(gmpo, inputs, fused=False)  # GMPOTrainer's own method
    loss, grads = parity.loss_and_grads(turbo, inputs, fused=True)
    torch.testing.assert_close(loss, expected_loss, rtol=2e-5, atol=1e-7)
    assert grads.keys() == expected_grads.keys() and grads
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=2e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    assert turbo._metrics["train"]["clip_ratio/region_mean"][-1] == gmpo._metrics["train"]["clip_ratio/region_mean"][-1]


# ------------------------------------------------------------------------------------------------------- fp16
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: on CPU, Accelerate's fp16 has no autocast")
@pytest.mark.parametrize("loss_type", ["dapo", *losses.TURBO_LOSS_TYPES])
def test_fp16_training_runs_the_fused_path_in_fp16_with_loss_scaling(tmp_path, loss_type, monkeypatch):
    """fp16=True: the fused kernel's GEMMs run in fp16 under autocast, the loss is scaled by a GradScaler, and a few
    optimizer steps leave finite parameters."""
    seen = []

    def spy(hidden, weight, targets, **kwargs):
        seen.append(torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else hidden.dtype)
        return fused_logprobs(hidden, weight, targets, **kwargs)

    monkeypatch.setattr(trl_trainer, "fused_logprobs", spy)
    config = parity.base_config_kwargs(str(tmp_path), fp16=True, use_cpu=False, max_steps=3, loss_type=loss_type)
    trainer = parity.build_trainer(config, peft=True)
    assert trainer.accelerator.scaler is not None
    trainer.train()
    assert seen and set(seen) == {torch.float16}
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_fp16_config_on_cpu_is_not_mixed_precision(tmp_path):
    """Documents the CPU limit behind the GPU-only test above: Accelerate gives CPU fp16 no autocast and no scaler,
    so an fp16=True CPU run computes in fp32 (the fp16 kernel/loss path is covered by the fp16 kernel cases)."""
    trainer = parity.build_trainer(parity.base_config_kwargs(str(tmp_path), fp16=True), peft=True)
    assert trainer.accelerator.scaler is None


# ------------------------------------------------------------------------------------------------ config surface
CPU = {"bf16": False, "use_cpu": True, "report_to": "none"}


def make(tmp_path, **kwargs):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=str(tmp_path), **CPU, **kwargs)


@pytest.mark.parametrize("loss_type", losses.TURBO_LOSS_TYPES)
def test_new_loss_types_are_accepted(tmp_path, loss_type):
    assert make(tmp_path, loss_type=loss_type).loss_type == loss_type


def test_new_fields_from_yaml_and_cli(tmp_path):
    from trl import GRPOConfig, TrlParser

    yaml_path = tmp_path / "config.yaml"
    yaml_path.write_text(
        f"output_dir: {tmp_path}\nbf16: false\nuse_cpu: true\nreport_to: none\nloss_type: clip_cov\n"
        "turbo_clip_cov_ratio: 0.001\nturbo_dual_clip: 3.0\nvllm_importance_sampling_mode: sequence_geometric_mask\n"
    )
    (config,) = TrlParser((GRPOConfig,)).parse_args_and_config(
        ["--config", str(yaml_path), "--turbo_clip_cov_ub", "4.0", "--turbo_clip_cov_lb", "0.5"]
    )
    assert (config.loss_type, config.turbo_clip_cov_ratio, config.turbo_dual_clip) == ("clip_cov", 0.001, 3.0)
    assert (config.turbo_clip_cov_ub, config.turbo_clip_cov_lb) == (4.0, 0.5)
    assert config.vllm_importance_sampling_mode == "sequence_geometric_mask"
    (config,) = TrlParser((GRPOConfig,)).parse_args_and_config(
        ["--config", str(yaml_path), "--loss_type", "kl_cov", "--turbo_dual_clip", "None", "--turbo_clip_cov_ratio",
         "2e-4", "--turbo_kl_cov_coef", "0.5", "--turbo_kl_cov_ratio", "0.01"]
    )
    assert (config.loss_type, config.turbo_kl_cov_coef, config.turbo_kl_cov_ratio) == ("kl_cov", 0.5, 0.01)


INVALID = {
    "dual_clip_without_ratio_clipping": (dict(loss_type="cispo", turbo_dual_clip=3.0), "no PPO-style ratio clipping"),
    "dual_clip_on_reinforce": (dict(loss_type="reinforce", turbo_dual_clip=3.0), "no PPO-style ratio clipping"),
    "dual_clip_on_gmpo": (dict(loss_type="gmpo", turbo_dual_clip=3.0), "no PPO-style ratio clipping"),
    "dual_clip_not_above_one": (dict(turbo_dual_clip=1.0), "finite number > 1"),
    "dual_clip_infinite": (dict(turbo_dual_clip=float("inf")), "finite number > 1"),
    "dual_clip_without_fused_loss": (dict(turbo_dual_clip=3.0, turbo_fused_loss=False), "turbo_fused_loss=True"),
    "clip_cov_setting_without_fused_loss": (dict(turbo_clip_cov_ub=4.0, turbo_fused_loss=False),
                                            "turbo_fused_loss=True"),
    "kl_cov_setting_with_other_loss": (dict(loss_type="dapo", turbo_kl_cov_coef=0.5), "no effect"),
    "clip_cov_setting_with_kl_cov": (dict(loss_type="kl_cov", turbo_clip_cov_ratio=1e-3), "no effect"),
    "kl_cov_coef_nan": (dict(loss_type="kl_cov", turbo_kl_cov_coef=float("nan")), "finite number >= 0"),
    "kl_cov_coef_infinite": (dict(loss_type="kl_cov", turbo_kl_cov_coef=float("inf")), "finite number >= 0"),
    "delta_on_kl_cov": (dict(loss_type="kl_cov", delta=1.5), "delta=None"),
    "delta_on_reinforce": (dict(loss_type="reinforce", delta=1.5), "delta=None"),
    "delta_on_gmpo": (dict(loss_type="gmpo", delta=1.5), "delta=None"),
    "reinforce_reused_generation": (dict(loss_type="reinforce", steps_per_generation=4,
                                         gradient_accumulation_steps=1), "multiple of `steps_per_generation`"),
    "vespo_sequence_is_mode": (dict(loss_type="vespo", use_vllm=True,
                                    vllm_importance_sampling_mode="sequence_mask"), "token_truncate"),
    "vespo_geometric_is_mode": (dict(loss_type="vespo", use_vllm=True,
                                     vllm_importance_sampling_mode="sequence_geometric_mask"), "token_truncate"),
    "vespo_sequence_is_mode_stock": (dict(loss_type="vespo", use_vllm=True, turbo_fused_loss=False,
                                          vllm_importance_sampling_mode="sequence_mask"), "token_truncate"),
    "new_loss_type_without_fused_loss": (dict(loss_type="gmpo", turbo_fused_loss=False), "turbo_fused_loss=True"),
    "new_is_mode_without_fused_loss": (
        dict(vllm_importance_sampling_mode="sequence_geometric_mask", turbo_fused_loss=False), "turbo_fused_loss=True"
    ),
    "geometric_truncate_without_bounds": (
        dict(vllm_importance_sampling_mode="sequence_geometric_truncate", vllm_importance_sampling_clip_max=None),
        "clip_min",
    ),
    "gmpo_sequence_level": (dict(loss_type="gmpo", importance_sampling_level="sequence"), "'token'"),
    "kl_cov_sequence_level": (dict(loss_type="kl_cov", importance_sampling_level="sequence"), "'token'"),
    "reinforce_multi_iteration": (dict(loss_type="reinforce", num_iterations=2), "num_iterations=1"),
    "clip_cov_ratio_zero": (dict(loss_type="clip_cov", turbo_clip_cov_ratio=0.0), "turbo_clip_cov_ratio"),
    "kl_cov_ratio_above_one": (dict(loss_type="kl_cov", turbo_kl_cov_ratio=2.0), "turbo_kl_cov_ratio"),
    "clip_cov_bounds_swapped": (dict(loss_type="clip_cov", turbo_clip_cov_lb=5.0, turbo_clip_cov_ub=1.0),
                                "turbo_clip_cov_lb"),
    "kl_cov_negative_coef": (dict(loss_type="kl_cov", turbo_kl_cov_coef=-1.0), "turbo_kl_cov_coef"),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_combinations_fail_at_config_time(tmp_path, case):
    kwargs, message = INVALID[case]
    with pytest.raises(ValueError, match=message):
        make(tmp_path, **kwargs)


def test_settings_that_act_are_accepted(tmp_path):
    """The counterparts of the refusals above: each setting where it acts."""
    make(tmp_path, loss_type="kl_cov", turbo_kl_cov_coef=0.5, turbo_kl_cov_ratio=0.01)
    make(tmp_path, loss_type="clip_cov", turbo_clip_cov_ratio=1e-3, turbo_clip_cov_lb=0.5, turbo_dual_clip=3.0,
         delta=1.5)
    make(tmp_path, loss_type="reinforce", steps_per_generation=2, gradient_accumulation_steps=4)
    make(tmp_path, loss_type="vespo", use_vllm=True, vllm_importance_sampling_mode="token_mask")
    make(tmp_path, loss_type="vespo", use_vllm=True, vllm_importance_sampling_mode="sequence_mask",
         vllm_importance_sampling_correction=False)


def test_gmpo_token_level_is_correction_fails(tmp_path):
    with pytest.raises(ValueError, match="sequence-level"):
        make(tmp_path, loss_type="gmpo", use_vllm=True, vllm_importance_sampling_mode="token_truncate")


def test_geometric_mode_needs_reuse(tmp_path):
    with pytest.raises(ValueError, match="turbo_reuse_policy_logps=True"):
        make(tmp_path, use_vllm=True, vllm_importance_sampling_mode="sequence_geometric_mask",
             turbo_reuse_policy_logps=False)
