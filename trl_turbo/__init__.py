"""trl_turbo: `import trl_turbo` before a TRL GRPO script makes GRPOTrainer faster and lighter, same results.

Importing the package patches TRL at stable seams (`trl_turbo.patch()`); `trl_turbo.unpatch()` restores every
original object. Features are switched by `turbo_*` fields that become part of TRL's own `GRPOConfig`.

Layout, imports pointing down only: `kernels/` (Triton kernels and launchers; torch and triton only) -> `ops/`
(autograd Functions over them) -> `losses` (the one spec of the loss family) -> feature code (`grpo/`, `offload/`,
`vllm/`, reading the one table of model families, `families`) -> `patches/` (seams) -> the package and CLI entry
points. `config` declares the `turbo_*` fields; `registry`, `versions` and `vllm_contract` (what the engine code
needs of vLLM, checked on its sources) are the shared utilities below them all.
Host libraries' internals are patched and reached only in `patches/`, `vllm/engine.py` (vLLM's worker, LoRA manager and
4-bit loader) and `vllm/standby.py` (its allocator), and, scoped to one call, by the `trl-turbo` command's launcher and
the test and bench harnesses; `grpo/loss_step.py` is the body of GRPOTrainer's `_compute_loss` and reads the trainer as
that method does. Every patch goes through `registry` (`registry.active_patches()` lists them): the host classes' at
`patch()`, a model's (module forwards, checkpoint functions, its checkpointing runtime) when a trainer configures it
(`unpatch()` restores these), and scoped ones that last for a block (a dequantize-once scope's forwards) and come back
however it ends.
"""

from __future__ import annotations

from . import registry as _registry
from .patches import apply_all as _apply_all
from .patches import restore_all as _restore_all

__version__ = "0.1.0"
__all__ = ["__version__", "is_patched", "patch", "plan", "unpatch"]


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


def plan(*args, **kwargs):
    """The memory forecast of a GRPO run per phase, for trl_turbo and stock TRL (`trl_turbo.planning.plan`;
    printing the result gives `trl-turbo plan`'s table)."""
    from .planning import plan as forecast

    return forecast(*args, **kwargs)


def is_patched() -> bool:
    return _registry.is_active()


patch()
