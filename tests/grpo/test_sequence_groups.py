"""The group arithmetic of `grpo.sequence_groups`, which the trainer and the memory forecast (`planning.training`)
both use: whole sequences per group, within the token budget, as few groups as that allows."""

from __future__ import annotations

import pytest

from trl_turbo.grpo.sequence_groups import group_count
from trl_turbo.planning.training import MicroBatch, token_groups


@pytest.mark.parametrize("sequences, length, budget, expected", [
    (8, 100, 800, 1),  # fits exactly
    (8, 100, 799, 2),  # 7 per group would do, but groups split evenly: 2 groups of 4
    (8, 100, 250, 4),  # 2 per group
    (8, 100, 50, 8),  # longer than the budget: one sequence per group, never fewer than one
    (5, 100, 300, 2),  # 3 + 2
    (1, 5000, 100, 1),  # a single sequence cannot be split
])
def test_group_count(sequences, length, budget, expected):
    count = group_count(sequences, length, budget)
    assert count == expected
    per_group = -(-sequences // count)
    assert count == 1 or per_group * length <= max(budget, length)


def test_the_forecast_groups_as_the_trainer_does():
    for sequences, length, budget in [(16, 2112, 32768), (16, 2112, 8192), (8, 20544, 32768), (3, 10, 25)]:
        rows, groups = token_groups(MicroBatch(sequences=sequences, sequence_tokens=length), budget)
        assert groups == group_count(sequences, length, budget)
        assert rows == -(-sequences // groups)
    assert token_groups(MicroBatch(sequences=16, sequence_tokens=2112), None) == (16, 1)
