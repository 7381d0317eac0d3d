"""Two-number addition for a real instruct model: the main example's task and the GPU learning curves' task.

Design decision: the problems are the shipped arithmetic task's sums (operands 0..50, drawn by its seeded generator,
the first 200 held out), asked in plain words with a system prompt, and the reply is free-form ("The result of
48 + 26 is 74."): its last integer is the answer. Greedy, SmolLM2-135M-Instruct gets about 30% of them right, so
the correctness reward has room to rise. The example and the benchmark import this one definition, so the curves on
the GPU measure the task a user runs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import datasets
import torch

from . import arithmetic

SYSTEM = "You are a calculator. Reply with the result only."
HELD_OUT = 200
MAX_COMPLETION = 16


def problems() -> tuple[datasets.Dataset, datasets.Dataset]:
    """Train and held-out sums as chat prompts with their answers (disjoint: the generator never repeats one)."""
    sums = [p for p in arithmetic.generate_problems(3000, arithmetic.SEED) if "+" in p["question"]]
    rows = [{"prompt": [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": p["question"].replace("+", " + ")}],
             "answer": p["answer"]} for p in sums]
    return datasets.Dataset.from_list(rows[HELD_OUT:]), datasets.Dataset.from_list(rows[:HELD_OUT])


def last_integer(text: str) -> str | None:
    numbers = re.findall(r"-?\d+", text)
    return numbers[-1] if numbers else None


def accuracy_reward(prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[str],
                    **kwargs: Any) -> list[float]:
    """1.0 when the reply's last integer is the answer, else 0.0."""
    return [float(last_integer(arithmetic.completion_text(c)) == a) for c, a in zip(completions, answer)]


@torch.no_grad()
def greedy_replies(model: torch.nn.Module, tokenizer: Any, problems: datasets.Dataset, batch: int = 50) -> list[str]:
    """The model's greedy replies to `problems`' prompts (at most MAX_COMPLETION tokens); the model's train/eval mode
    is left as it was (TRL files a step's metrics under the mode it finds the model in)."""
    was_training = model.training
    model.eval()
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    replies: list[str] = []
    try:
        for start in range(0, len(problems), batch):
            rows = problems[start:start + batch]
            inputs = tokenizer.apply_chat_template(rows["prompt"], add_generation_prompt=True, padding=True,
                                                   return_tensors="pt", return_dict=True).to(model.device)
            output = model.generate(**inputs, max_new_tokens=MAX_COMPLETION, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id)
            replies += tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return replies


def accuracy_of(replies: Sequence[str], answers: Sequence[str]) -> float:
    """Share of `replies` whose last integer is the answer."""
    return sum(last_integer(reply) == answer for reply, answer in zip(replies, answers)) / len(answers)


def held_out_accuracy(model: torch.nn.Module, tokenizer: Any, held_out: datasets.Dataset) -> float:
    """Greedy-decoded accuracy on `held_out`."""
    return accuracy_of(greedy_replies(model, tokenizer, held_out), held_out["answer"])


def difference_noise(before: float, after: float, count: int) -> float:
    """Binomial standard error of the difference of two accuracies on `count` problems (as if independent:
    conservative)."""
    return ((before * (1 - before) + after * (1 - after)) / count) ** 0.5
