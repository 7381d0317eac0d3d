"""Reversible attribute patches.

A patch is "set attribute `name` of `owner` to `value`". The registry remembers what was there before (or that
nothing was), so `restore_all()` puts every original object back in reverse order. Applying the same patch twice is a
no-op, which is what makes `trl_turbo.patch()` idempotent. No source text of another library is ever read or rewritten.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

_MISSING = object()


@dataclass
class _Record:
    owner: Any
    name: str
    original: Any
    value: Any


_records: list[_Record] = []
lock = threading.RLock()


def set_attr(owner: Any, name: str, value: Any) -> None:
    """Set `owner.name = value`, remembering the original for `restore_all()`."""
    with lock:
        for record in _records:
            if record.owner is owner and record.name == name:
                if record.value is value:
                    return
                raise RuntimeError(f"trl_turbo: {owner!r}.{name} is already patched with another value")
        original = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name, _MISSING)
        setattr(owner, name, value)
        _records.append(_Record(owner, name, original, value))


def original(owner: Any, name: str) -> Any:
    """The object that was at `owner.name` before trl_turbo patched it (the current one when unpatched)."""
    with lock:
        for record in _records:
            if record.owner is owner and record.name == name:
                return record.original
    return getattr(owner, name)


def restore_all() -> None:
    with lock:
        while _records:
            record = _records.pop()
            if record.original is _MISSING:
                delattr(record.owner, record.name)
            else:
                setattr(record.owner, record.name, record.original)


def is_active() -> bool:
    return bool(_records)
