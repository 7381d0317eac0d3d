"""pyproject's dependency bounds are the supported ranges `trl_turbo.versions` declares (one source, mirrored)."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

from trl_turbo import versions


def _bounds(requirements: list[str]) -> dict[str, tuple[str, str]]:
    found = {}
    for requirement in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_-]+)>=([0-9.]+),<([0-9.]+)", requirement.split(";")[0].strip())
        if match:
            found[match[1]] = (match[2], match[3])
    return found


def test_pyproject_bounds_mirror_the_supported_ranges():
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    required = _bounds(project["dependencies"])
    for package, bounds in {**versions.SUPPORTED, "peft": versions.SUPPORTED_OPTIONAL["peft"]}.items():
        assert required.get(package) == bounds, (package, required.get(package), bounds)
    assert _bounds(project["optional-dependencies"]["vllm"]) == versions.VLLM_ENGINE
