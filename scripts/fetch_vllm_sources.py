"""Download vLLM wheels (no dependencies) and keep only their Python sources, for the contract check.

    python scripts/fetch_vllm_sources.py 0.24.0 0.25.1 0.26.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0
    python scripts/fetch_vllm_sources.py --check      # check every cached version against the contract

Sources go to `.cache/vllm-sources/<version>/vllm/` (git-ignored; never committed); each wheel is deleted once its
`.py` files are out. `tests/sampler/test_vllm_contract.py` reads the cache when it exists.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

CACHE = Path(__file__).resolve().parents[1] / ".cache" / "vllm-sources"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def fetch(version: str) -> Path:
    target = CACHE / version
    if (target / "vllm").is_dir():
        return target
    with tempfile.TemporaryDirectory() as folder:
        platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", *platforms, "-d", folder, f"vllm=={version}"], check=True)
        wheel = next(Path(folder).glob("vllm-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                if name.startswith("vllm/") and name.endswith(".py") or name.endswith(".dist-info/METADATA"):
                    archive.extract(name, target)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="*")
    parser.add_argument("--check", action="store_true", help="check the cached versions against the contract")
    options = parser.parse_args()
    for version in options.versions:
        print(f"vllm {version}: {fetch(version)}")
    if options.check:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from trl_turbo.vllm_contract import broken_requirements, generation_for, verdict

        for folder in sorted(CACHE.iterdir()):
            generation = generation_for(folder.name)
            broken = broken_requirements(folder / "vllm", generation.contract) if generation else []
            judged = verdict(folder.name, folder / "vllm")
            outcome = "refused" if judged.error else "accepted" + (", GPU-verified" if not judged.notice else "")
            print(f"vllm {folder.name} (API generation {generation.name if generation else '-'}): {outcome}; "
                  + ("keeps the contract" if not broken else f"{len(broken)} broken"))
            for requirement, problem in broken:
                print(f"  - {problem}" + (f" [only {requirement.feature}]" if requirement.feature else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
