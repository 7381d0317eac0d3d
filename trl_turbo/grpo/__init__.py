"""GRPO feature code that is pure (no host-library internals): the rollout sanity alarm."""
