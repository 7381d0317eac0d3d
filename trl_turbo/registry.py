"""Reversible attribute patches: every patch trl_turbo makes on another library's objects goes through here, on
classes and modules of TRL, transformers and vLLM and on instances alike (a model's modules, its checkpointing runtime,
a bitsandbytes layer's forward for a dequantize-once scope).

A patch is "set attribute `name` of `owner` to `value`". The registry remembers what was there before (or that
nothing was), so `restore_all()` puts every original object back in reverse order. Applying the same patch twice is a
no-op, which is what makes `trl_turbo.patch()` idempotent. No source text of another library is ever read or rewritten.
Patches on object instances (a model's modules) hold their owner weakly, so the registry never keeps a model alive.
A scoped patch (`scoped`) lasts for a block and nests: it puts back whatever was there when the block began.
`active_patches()` lists every patch in force, permanent and scoped.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_MISSING = object()


@dataclass(eq=False)  # records are told apart by identity: their owners and values may not compare (tensors)
class _Record:
    owner_ref: Any  # the owner, or a weakref to it for instance patches
    weak: bool
    name: str
    original: Any
    value: Any

    @property
    def owner(self) -> Any:
        return self.owner_ref() if self.weak else self.owner_ref


_records: list[_Record] = []
_scoped: list[_Record] = []
_restore_callbacks: list = []
lock = threading.RLock()


def on_restore(callback) -> None:
    """Run `callback()` at the next `restore_all()`, before attributes are restored (state kept outside attributes)."""
    with lock:
        if callback not in _restore_callbacks:
            _restore_callbacks.append(callback)


def _own_value(owner: Any, name: str) -> Any:
    """What `owner` itself holds at `name` (`_MISSING` when the attribute comes from its class or is absent)."""
    return owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name, _MISSING)


def set_attr(owner: Any, name: str, value: Any, *, weak: bool = False) -> None:
    """Set `owner.name = value`, remembering the original for `restore_all()` (`weak`: do not keep `owner` alive)."""
    with lock:
        _records[:] = [r for r in _records if r.owner is not None]
        for record in _records:
            if record.owner is owner and record.name == name:
                if record.value is value:
                    return
                raise RuntimeError(f"trl_turbo: {owner!r}.{name} is already patched with another value")
        original = _own_value(owner, name)
        setattr(owner, name, value)
        _records.append(_Record(weakref.ref(owner) if weak else owner, weak, name, original, value))


def replace_attr(owner: Any, name: str, value: Any, *, weak: bool = False) -> None:
    """`set_attr`, except that an earlier trl_turbo patch of the same attribute is replaced (the original it saved
    stays the one `restore_all()` puts back): for features that wrap or supersede each other on a module."""
    with lock:
        for record in _records:
            if record.owner is owner and record.name == name:
                setattr(owner, name, value)
                record.value = value
                return
        set_attr(owner, name, value, weak=weak)


def original(owner: Any, name: str) -> Any:
    """The object that was at `owner.name` before trl_turbo patched it (the current one when unpatched)."""
    with lock:
        for record in _records:
            if record.owner is owner and record.name == name:
                return record.original
    return getattr(owner, name)


def restore_attr(owner: Any, name: str) -> bool:
    """Put back what was at `owner.name` before trl_turbo patched it and forget the patch; False if not patched."""
    with lock:
        for index, record in enumerate(_records):
            if record.owner is owner and record.name == name:
                del _records[index]
                if record.original is _MISSING:
                    delattr(owner, name)
                else:
                    setattr(owner, name, record.original)
                return True
    return False


def restore_all() -> None:
    with lock:
        while _restore_callbacks:
            _restore_callbacks.pop()()
        while _records:
            record = _records.pop()
            if record.owner is None:  # an instance that no longer exists
                continue
            if record.original is _MISSING:
                delattr(record.owner, record.name)
            else:
                setattr(record.owner, record.name, record.original)


@contextlib.contextmanager
def scoped(owner: Any, name: str, value: Any) -> Iterator[None]:
    """`owner.name = value` inside the block; what was there before comes back however the block ends."""
    with lock:
        previous = _own_value(owner, name)
        setattr(owner, name, value)
        record = _Record(owner, False, name, previous, value)
        _scoped.append(record)
    try:
        yield
    finally:
        with lock:
            _scoped.remove(record)
            if previous is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)


def active_patches() -> list[tuple[Any, str, Any]]:
    """(owner, attribute name, value) of every patch in force: permanent ones first, then scoped ones."""
    with lock:
        return [(r.owner, r.name, r.value) for r in (*_records, *_scoped) if r.owner is not None]


def scoped_patches() -> list[tuple[Any, str, Any]]:
    """(owner, attribute name, value) of the scoped patches in force (none outside a patched call)."""
    with lock:
        return [(r.owner, r.name, r.value) for r in _scoped]


def is_active() -> bool:
    return bool(_records)
