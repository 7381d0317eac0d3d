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


@pytest.mark.parametrize("sequences, length, budget, rows, groups", [
    (16, 2112, 32768, 8, 2),  # 33792 tokens: 15 sequences would fit, split evenly into 2 groups of 8
    (16, 2112, 8192, 3, 6),  # 3 sequences (6336 tokens) a group: 6 groups of at most 3
    (8, 20544, 32768, 1, 8),  # one sequence a group
    (3, 10, 25, 2, 2),  # 2 + 1
    (16, 2112, None, 16, 1),  # no budget: one forward
])
def test_the_forecast_groups_as_the_trainer_does(sequences, length, budget, rows, groups):
    assert token_groups(MicroBatch(sequences=sequences, sequence_tokens=length), budget) == (rows, groups)
    if budget is not None:
        assert group_count(sequences, length, budget) == groups
