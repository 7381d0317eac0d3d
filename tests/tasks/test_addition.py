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


def test_accuracy_of_replies() -> None:
    assert addition.accuracy_of(["it is 74", "75", "the sum: 3"], ["74", "74", "3"]) == 2 / 3


def test_greedy_replies_answer_every_problem_and_leave_the_mode() -> None:
    import torch

    from trl_turbo.testing.models import tiny_model
    from trl_turbo.testing.tokenizer import VOCAB, build_tokenizer

    tokenizer = build_tokenizer()
    model = tiny_model("llama", vocab_size=len(VOCAB), dtype=torch.float32)
    model.train()
    _, held_out = addition.problems()
    problems = held_out.select(range(3))
    replies = addition.greedy_replies(model, tokenizer, problems, batch=2)
    assert len(replies) == 3 and all(isinstance(reply, str) for reply in replies)
    assert model.training and tokenizer.padding_side == build_tokenizer().padding_side
    assert addition.held_out_accuracy(model, tokenizer, problems) == addition.accuracy_of(replies, problems["answer"])
