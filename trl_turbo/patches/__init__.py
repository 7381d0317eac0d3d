"""The only code that touches TRL, transformers, PEFT and vLLM internals.

`apply_all()` installs every patch through `registry` (so `restore_all()` undoes all of them) after checking the
supported versions once: outside them it warns, naming what was found and what is supported, and leaves the host
libraries stock.
"""

from __future__ import annotations

import warnings

from .. import registry, versions

_warned = False


def apply_all() -> bool:
    """Install all patches; returns False (after one warning) when the installed versions are unsupported."""
    global _warned
    reason = versions.unsupported_reason()
    if reason is not None:
        if not _warned:
            warnings.warn(
                f"trl_turbo is inactive: {reason}. TRL runs stock. Install a supported version to enable it.",
                RuntimeWarning,
                stacklevel=3,
            )
            _warned = True
        return False
    from . import (
        accelerate_fsdp2,
        transformers_checkpointing,
        trl_config,
        trl_step_metrics,
        trl_trainer,
        trl_trainer_init,
        trl_vllm,
    )

    try:
        trl_config.apply()
        trl_trainer.apply()
        trl_trainer_init.apply()
        transformers_checkpointing.apply()
        trl_step_metrics.apply()
        trl_vllm.apply()
        accelerate_fsdp2.apply()
    except BaseException:
        registry.restore_all()
        raise
    return True


def restore_all() -> None:
    registry.restore_all()
