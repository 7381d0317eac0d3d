"""trl_turbo: `import trl_turbo` before a TRL GRPO script makes GRPOTrainer faster and lighter, same results.

Importing the package patches TRL at stable seams (`trl_turbo.patch()`); `trl_turbo.unpatch()` restores every
original object. Features are switched by `turbo_*` fields that become part of TRL's own `GRPOConfig`.
"""

from __future__ import annotations

from .patches import apply_all as _apply_all
from . import registry as _registry
from .patches import restore_all as _restore_all

__version__ = "0.1.0"
__all__ = ["__version__", "is_patched", "patch", "unpatch"]


def patch() -> bool:
    """Patch TRL (idempotent). Returns whether trl_turbo is active (False when host versions are unsupported)."""
    with _registry.lock:
        if _registry.is_active():
            return True
        return _apply_all()


def unpatch() -> None:
    """Restore every object trl_turbo replaced; TRL is stock afterwards. `patch()` re-applies. A GRPOConfig subclass
    defined while patched keeps the `turbo_*` fields in its own dataclass `__init__` (unused once unpatched)."""
    with _registry.lock:
        _restore_all()


def is_patched() -> bool:
    return _registry.is_active()


patch()
