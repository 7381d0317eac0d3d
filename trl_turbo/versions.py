"""Supported host-library versions, declared once.

Every patch module asks `unsupported_reason()` before touching anything; outside these ranges trl_turbo warns once
(naming the versions found and the supported ranges) and leaves TRL stock, rather than failing deep inside a step.
The ranges are what the test suite runs against; pyproject's dependency bounds mirror them.
"""

from __future__ import annotations

import importlib.metadata

from packaging.version import Version

# package -> (lowest supported, first unsupported)
SUPPORTED: dict[str, tuple[str, str]] = {
    "trl": ("1.16.0", "1.17.0"),
    "transformers": ("5.17.0", "6.0.0"),
    "torch": ("2.8.0", "3.0.0"),
}
# Optional libraries, checked where a feature needs them: vLLM by precision matching (outside: a warning, TRL's dtype),
# peft by shared weights (outside: a config-time error).
SUPPORTED_OPTIONAL: dict[str, tuple[str, str]] = {
    "vllm": ("0.22.0", "0.32.0"),
    "peft": ("0.17.0", "1.0.0"),
}
# vLLM for the engine features (shared weights, standby, adapters from tensors), which use vLLM's worker internals:
# every version in this range is GPU-verified (the minors below) or keeps its API generation's contract
# (`vllm_contract`, checked on the installed sources at config time).
VLLM_ENGINE: dict[str, tuple[str, str]] = {"vllm": ("0.24.0", "0.32.0")}
VLLM_GPU_VERIFIED: tuple[str, ...] = ("0.24", "0.25", "0.26")


def importable(module: str) -> bool:
    """Whether `module` can be imported (as TRL decides availability; a distribution may carry another name)."""
    import importlib.util

    return importlib.util.find_spec(module) is not None


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _in_range(version: str, bounds: tuple[str, str]) -> bool:
    # Local build tags (2.11.0+cu130) and pre-releases of a supported minor count as that minor.
    v = Version(Version(version).base_version)
    return Version(bounds[0]) <= v < Version(bounds[1])


def unsupported_reason(packages: dict[str, tuple[str, str]] = SUPPORTED) -> str | None:
    """Return a human-readable reason when an installed version is outside its supported range, else None."""
    problems = []
    for package, bounds in packages.items():
        version = installed_version(package)
        if version is None:
            problems.append(f"{package} is not installed (supported: >={bounds[0]},<{bounds[1]})")
        elif not _in_range(version, bounds):
            problems.append(f"{package}=={version} (supported: >={bounds[0]},<{bounds[1]})")
    return "; ".join(problems) if problems else None
