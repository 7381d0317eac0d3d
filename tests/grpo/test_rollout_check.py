"""The rollout sanity alarm on CPU: its rule on gap series (healthy runs, a sampler that stopped following the
policy, non-finite gaps), and its seam, which reads TRL's logged gap across TRL's log-time clears and warns or raises
once. On the GPU, tests/sampler/test_vllm_families.py trips it with a skipped adapter push and checks that healthy runs
in both sampling modes never do."""

from __future__ import annotations

import math
import types
import warnings
from collections import defaultdict

import pytest

from trl_turbo.grpo.rollout_check import RolloutCheck, RolloutMismatch
from trl_turbo.grpo.step_metrics import check_rollout


def _run(gaps):
    check = RolloutCheck()
    return [check.observe(g) for g in gaps], check


def test_healthy_runs_never_trip():
    # numerics-level gaps that wander (bf16 sampler vs trainer), including a slow rise as the policy sharpens
    for gaps in ([0.003] * 200, [0.004, 0.003] + [0.003 + 0.00005 * i for i in range(200)],
                 [0.064, 0.065] + [0.06 + 0.01 * (i % 3) for i in range(100)]):
        messages, check = _run(gaps)
        assert not any(messages) and not check.tripped, gaps[:5]


def test_a_sampler_that_stopped_following_the_policy_trips_once():
    gaps = [0.002, 0.002, 0.004, 0.01, 0.03, 0.06, 0.09, 0.12, 0.15]
    messages, check = _run(gaps)
    tripped = [i for i, m in enumerate(messages) if m]
    assert tripped == [5], messages  # 0.03 and 0.06 are above max(4 x 0.002, 0.002 + 0.02): two in a row
    assert "do not come from the policy" in messages[5] and "0.0600" in messages[5] and "0.0020" in messages[5]
    assert check.threshold == pytest.approx(0.022)


def test_one_outlier_does_not_trip_and_nan_is_ignored():
    messages, _ = _run([0.002, 0.003, 0.5, 0.002, math.nan, 0.6, 0.002, 0.7])
    assert not any(messages)


def _trainer(mode):
    return types.SimpleNamespace(args=types.SimpleNamespace(turbo_rollout_check=mode),
                                 _metrics={"train": defaultdict(list)})


def _log(trainer, gap):
    trainer._metrics["train"]["sampling/sampling_logp_difference/mean"].append(gap)
    check_rollout(trainer, trainer._metrics["train"])


def test_the_seam_reads_each_logged_gap_once_across_trl_clears():
    trainer = _trainer("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for gap in (0.002, 0.002, 0.004):
            _log(trainer, gap)
            check_rollout(trainer, trainer._metrics["train"])  # a micro-step without a new generation reads nothing new
            trainer._metrics["train"].clear()  # TRL's log() clears the metrics
        _log(trainer, 0.05)
        _log(trainer, 0.07)
        _log(trainer, 0.09)  # tripped once only
    alarms = [w for w in caught if "do not come from the policy" in str(w.message)]
    assert len(alarms) == 1 and trainer._trl_turbo_rollout.check.floor == 0.002


def test_error_mode_raises_and_off_reads_nothing():
    trainer = _trainer("error")
    for gap in (0.002, 0.002, 0.05):
        _log(trainer, gap)
    with pytest.raises(RolloutMismatch, match="stale or missing adapter"):
        _log(trainer, 0.06)
    off = _trainer("off")
    for gap in (0.002, 0.002, 0.5, 0.5, 0.5):
        _log(off, gap)
    assert not hasattr(off, "_trl_turbo_rollout")


def test_rollout_check_field_is_validated(tmp_path):
    from trl import GRPOConfig

    import trl_turbo  # noqa: F401

    with pytest.raises(ValueError, match="turbo_rollout_check='loud'"):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, turbo_rollout_check="loud")
    assert GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False).turbo_rollout_check == "warn"
