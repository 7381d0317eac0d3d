"""The IS statistics of `bench is-gap`: every mode's verdict agrees with the loss's own masking and truncation, and
the prefix and quantile bookkeeping is right on hand-made log-ratios."""

from __future__ import annotations

import math

import pytest
import torch

from trl_turbo import losses
from trl_turbo.bench.is_gap import completion_log_ratios, histograms, is_statistics


def test_sequence_modes_count_the_completions_the_loss_masks() -> None:
    # Three completions of 4 tokens: sequence log-ratios 0.4, log(3) + 0.25 (outside C_max=3) and -2.0.
    rows = [torch.tensor([0.1, 0.1, 0.1, 0.1]), torch.tensor([math.log(3.0) + 0.05, 0.2, 0.0, 0.0]),
            torch.tensor([-0.5, -0.5, -0.5, -0.5])]
    stats = is_statistics(rows, clip_min=None, clip_max=3.0, prefixes=(2, 4))
    full = stats["by_prefix"]["4"]
    assert full["completions"] == 3
    assert full["modes"]["sequence_mask"]["changed"] == pytest.approx(1 / 3)
    assert full["modes"]["sequence_truncate"]["changed"] == pytest.approx(1 / 3)
    # geometric means 0.1, (log 3 + 0.25)/4, -0.5: none above log 3
    assert full["modes"]["sequence_geometric_mask"]["changed"] == 0.0
    # one token of 12 has a ratio above 3
    assert full["modes"]["token_mask"]["changed"] == pytest.approx(1 / 12)
    # prefix 2: sums 0.2, log 3 + 0.25, -1.0
    assert stats["by_prefix"]["2"]["modes"]["sequence_mask"]["changed"] == pytest.approx(1 / 3)
    assert stats["by_prefix"]["2"]["sequence_log_ratio_quantiles"]["q0.5"] == pytest.approx(0.2)
    # the loss's own verdict on the padded batch
    batch = torch.stack(rows).double()
    applied = losses.vllm_importance_sampling_ratio(batch, torch.zeros_like(batch), torch.ones_like(batch),
                                                    "sequence_mask", None, 3.0)
    assert (applied == 0).float().mean().item() == pytest.approx(full["modes"]["sequence_mask"]["changed"])
    # weights 0.4 -> e^0.4, masked -> 0, e^-2: their effective sample size and the share below 0.1
    weights = torch.tensor([math.exp(0.4), 0.0, math.exp(-2.0)], dtype=torch.float64)
    assert full["modes"]["sequence_mask"]["ess_fraction"] == pytest.approx(
        float(weights.sum() ** 2 / (3 * (weights**2).sum())))
    assert full["modes"]["sequence_mask"]["negligible"] == pytest.approx(1 / 3)  # the masked one (e^-2 = 0.135)
    assert full["modes"]["sequence_truncate"]["mean_weight"] == pytest.approx(
        float((math.exp(0.4) + 3.0 + math.exp(-2.0)) / 3))


def test_token_modes_count_tokens_and_a_lower_bound_counts_too() -> None:
    rows = [torch.tensor([2.0, -3.0, 0.0]), torch.tensor([0.0, 0.0])]
    stats = is_statistics(rows, clip_min=0.1, clip_max=3.0, prefixes=(2,))
    assert stats["tokens"] == 5 and stats["completions"] == 2
    # the prefix of 2 keeps tokens 2.0, -3.0 | 0.0, 0.0: e^2 above 3 and e^-3 below 0.1, two of four
    assert stats["by_prefix"]["2"]["modes"]["token_truncate"]["changed"] == pytest.approx(0.5)
    assert stats["mean_abs_log_ratio"] == pytest.approx(1.0)
    tokens = torch.tensor([2.0, -3.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    assert stats["k3_kl"] == pytest.approx(float((tokens.exp() - tokens - 1).mean()))


def test_completion_log_ratios_drop_padding_and_unscored_tokens() -> None:
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    sampler = torch.tensor([[-1.5, float("nan"), -2.0], [-1.0, -0.5, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rows = completion_log_ratios(trainer, sampler, mask)
    assert [r.tolist() for r in rows] == [[0.5, -1.0], [0.0, -0.5]]


def test_histograms_count_every_token_and_full_length_completion() -> None:
    rows = [torch.tensor([0.0, 5.0]), torch.tensor([0.1])]
    counts = histograms(rows, longest=2)
    assert sum(counts["token_counts"]) == 3  # 5.0 is clamped into the last bin
    assert sum(counts["sequence_counts"]) == 1  # only the completion of full length


def test_the_plot_draws_each_variants_histograms(tmp_path) -> None:
    from trl_turbo.bench.is_gap import plot

    counts = histograms([torch.tensor([0.0, 0.1]), torch.tensor([-0.2])], 2)
    rows = [{"ok": True, "name": "turbo", "histograms": counts}, {"ok": False, "name": "stock"}]
    plot(rows, "test", tmp_path / "gap.png")
    assert (tmp_path / "gap.png").stat().st_size > 0
