"""How an engine asks for one of trl_turbo's kernels inside vLLM: an entry of the engine argument
`additional_config`, read back from vLLM's current config while the engine builds its layers.

Design decision: vLLM hashes `additional_config` into the key of its compiled-graph cache, so a graph compiled with a
trl_turbo kernel is never loaded by an engine without it, nor the other way round. Each kernel has its own key in
that one dict, so requests combine (`combined`) instead of replacing each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ADDITIONAL_CONFIG = "additional_config"


def arguments(key: str, value: str) -> dict[str, Any]:
    """The engine arguments of one request."""
    return {ADDITIONAL_CONFIG: {key: value}}


def combined(*engine_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Engine arguments merged left to right, their `additional_config` dicts merged entry by entry (None counts as
    none); two different values for one entry are an error, not a silent choice."""
    merged: dict[str, Any] = {}
    for kwargs in engine_kwargs:
        for name, value in kwargs.items():
            if name != ADDITIONAL_CONFIG:
                merged[name] = value
                continue
            if value is None:
                continue
            if not isinstance(value, Mapping):
                raise TypeError(f"{ADDITIONAL_CONFIG} must be a dict to combine requests, got {type(value).__name__}")
            entries = merged.setdefault(ADDITIONAL_CONFIG, {})
            for key, entry in value.items():
                if key in entries and entries[key] != entry:
                    raise ValueError(f"{ADDITIONAL_CONFIG}[{key!r}] asked as {entries[key]!r} and as {entry!r}")
                entries[key] = entry
    return merged


def asked(config: Any, key: str, value: str) -> bool:
    """Whether the engine vLLM's `config` describes made this request."""
    additional = getattr(config, ADDITIONAL_CONFIG, None)
    return isinstance(additional, dict) and additional.get(key) == value


def current_config() -> Any:
    """vLLM's config of the engine being built (read while its layers are created)."""
    from vllm.config import get_current_vllm_config

    return get_current_vllm_config()
