"""Sanity probe: with reward = completion length and group-mean advantages, the patched trainer's mean completion
length rises to the cap; with learning rate 0 it does not. Catches sign and normalisation errors that parity with
a wrong reference could miss."""

from __future__ import annotations

import torch

from trl_turbo.tasks.arithmetic import make_length_reward
from trl_turbo.testing import parity
from trl_turbo.testing.tokenizer import EOS_ID

CAP = 16


def _mean_lengths(tmp_path, learning_rate: float, steps: int) -> list[float]:
    config = parity.base_config_kwargs(
        str(tmp_path), max_steps=steps, max_completion_length=CAP, per_device_train_batch_size=8,
        num_generations=8, learning_rate=learning_rate, optim="adamw_torch",
    )
    torch.manual_seed(0)
    trainer = parity.build_trainer(config, reward_funcs=[make_length_reward(CAP)],
                                   model_kwargs={"tie_word_embeddings": False})
    _make_model_stop_early(trainer.model)
    trainer.train()
    return [log["completions/mean_length"] for log in trainer.state.log_history if "completions/mean_length" in log]


@torch.no_grad()
def _make_model_stop_early(model: torch.nn.Module) -> None:
    """Point the EOS row of the LM head along the mean final hidden state, so a random model ends after ~3 tokens
    and the probe has room to rise."""
    weight = model.lm_head.weight
    ids = torch.randint(3, weight.shape[0], (8, 24), generator=torch.Generator().manual_seed(0))
    hidden = model(ids, output_hidden_states=True).hidden_states[-1].reshape(-1, weight.shape[1])
    direction = hidden.mean(0)
    weight[EOS_ID] += 3.0 * direction / direction.pow(2).sum()


def test_length_reward_saturates_at_the_cap(tmp_path):
    lengths = _mean_lengths(tmp_path, learning_rate=3e-4, steps=30)
    assert lengths[0] < CAP / 2, lengths
    assert sum(lengths[-5:]) / 5 >= 0.85 * CAP, lengths


def test_no_learning_without_updates(tmp_path):
    lengths = _mean_lengths(tmp_path, learning_rate=0.0, steps=10)
    assert max(lengths) < CAP / 2, lengths
