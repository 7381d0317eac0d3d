"""Learning checks for trl_turbo's own loss types: each one, trained on the length-reward probe (a shipped toy task:
reward = completion length / cap), raises the mean reward well above the same run with learning rate 0 and drives
the mean completion length to the cap. Catches sign and normalisation errors that a wrong reference could share.

Design: with learning rate 0 the parameters never move, so generation, rewards and the logged reward curve are the
same whatever the loss type; the lr=0 run is done once per session (module fixture) and every variant is compared
with it, instead of repeating an identical run per variant.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CAP, make_model_stop_early

from trl_turbo.tasks.arithmetic import make_length_reward
from trl_turbo.testing import parity

STEPS = 30
VARIANTS = {
    "gmpo": dict(loss_type="gmpo", epsilon=0.4),
    "clip_cov": dict(loss_type="clip_cov"),
    "kl_cov": dict(loss_type="kl_cov"),
    "gppo": dict(loss_type="gppo"),
    "reinforce": dict(loss_type="reinforce"),
    "dapo_dual_clip": dict(loss_type="dapo", turbo_dual_clip=3.0),
}


def _train(tmp_path, learning_rate: float, **config) -> tuple[list[float], list[float]]:
    """(mean reward, mean completion length) per step of a seeded length-probe run."""
    kwargs = parity.base_config_kwargs(
        str(tmp_path), max_steps=STEPS, max_completion_length=CAP, per_device_train_batch_size=8,
        num_generations=8, learning_rate=learning_rate, optim="adamw_torch",
    )
    kwargs.update(config)
    torch.manual_seed(0)
    trainer = parity.build_trainer(kwargs, reward_funcs=[make_length_reward(CAP)],
                                   model_kwargs={"tie_word_embeddings": False})
    make_model_stop_early(trainer.model)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "reward" in log]
    return [log["reward"] for log in logs], [log["completions/mean_length"] for log in logs]


@pytest.fixture(scope="module")
def frozen_rewards(tmp_path_factory) -> list[float]:
    rewards, lengths = _train(tmp_path_factory.mktemp("frozen"), learning_rate=0.0)
    assert max(lengths) < CAP / 2, lengths
    return rewards


def _tail(values: list[float]) -> float:
    return sum(values[-5:]) / 5


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_learns_the_length_probe(tmp_path, frozen_rewards, name):
    rewards, lengths = _train(tmp_path, learning_rate=3e-4, **VARIANTS[name])
    assert len(rewards) == len(frozen_rewards) == STEPS
    assert lengths[0] < CAP / 2, lengths
    assert _tail(rewards) > _tail(frozen_rewards) + 0.3, (rewards, frozen_rewards)
    assert _tail(lengths) >= 0.85 * CAP, lengths
