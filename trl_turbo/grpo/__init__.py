"""GRPO feature code: the loss step (the body of `_compute_loss`), sequence groups, the rollout sanity alarm."""
