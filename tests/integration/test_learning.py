"""Sanity probe: with reward = completion length and group-mean advantages, the patched trainer's mean completion
length rises to the cap; with learning rate 0 it does not. Catches sign and normalisation errors that parity with
a wrong reference could miss."""

from __future__ import annotations

import torch
from helpers import CAP, make_model_stop_early

from trl_turbo.tasks.arithmetic import make_length_reward
from trl_turbo.testing import parity


def _mean_lengths(tmp_path, learning_rate: float, steps: int) -> list[float]:
    config = parity.base_config_kwargs(
        str(tmp_path), max_steps=steps, max_completion_length=CAP, per_device_train_batch_size=8,
        num_generations=8, learning_rate=learning_rate, optim="adamw_torch",
    )
    torch.manual_seed(0)
    trainer = parity.build_trainer(config, reward_funcs=[make_length_reward(CAP)],
                                   model_kwargs={"tie_word_embeddings": False})
    make_model_stop_early(trainer.model)
    trainer.train()
    return [log["completions/mean_length"] for log in trainer.state.log_history if "completions/mean_length" in log]


def test_length_reward_saturates_at_the_cap(tmp_path):
    lengths = _mean_lengths(tmp_path, learning_rate=3e-4, steps=30)
    assert lengths[0] < CAP / 2, lengths
    assert sum(lengths[-5:]) / 5 >= 0.85 * CAP, lengths


def test_no_learning_without_updates(tmp_path):
    lengths = _mean_lengths(tmp_path, learning_rate=0.0, steps=10)
    assert max(lengths) < CAP / 2, lengths
