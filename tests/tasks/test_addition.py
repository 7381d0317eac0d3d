"""The addition task the main example and the GPU learning curves share."""

from __future__ import annotations

from trl_turbo.tasks import addition


def test_problems_are_disjoint_sums_with_their_answers() -> None:
    train, held_out = addition.problems()
    assert len(held_out) == addition.HELD_OUT and len(train) > 500
    questions = {row["prompt"][1]["content"] for row in train}
    assert not questions & {row["prompt"][1]["content"] for row in held_out}
    row = held_out[0]
    a, b = (int(x) for x in row["prompt"][1]["content"].split(" + "))
    assert row["answer"] == str(a + b) and row["prompt"][0]["content"] == addition.SYSTEM


def test_accuracy_reward_reads_the_last_integer() -> None:
    completions = ["The result of 48 + 26 is 74.", [{"role": "assistant", "content": "74 or 75"}], "no idea"]
    assert addition.accuracy_reward(None, completions, ["74", "74", "74"]) == [1.0, 0.0, 0.0]
    assert addition.last_integer("-3 and -12") == "-12"


def test_difference_noise() -> None:
    assert addition.difference_noise(0.5, 0.5, 100) == (0.005) ** 0.5
