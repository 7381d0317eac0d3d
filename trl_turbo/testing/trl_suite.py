"""TRL's own GRPO tests, run stock and with ``import trl_turbo`` first: every test that passes stock must pass with it.

Design decision: TRL's test code is never part of this repository. It is extracted at run time from a TRL source (a
git clone or mirror, at ``--ref``) into a temporary directory, beside stand-ins for the Hub repositories the tests load
(:mod:`trl_turbo.testing.hub_standins`, used through the libraries' offline mode). pytest then runs the same files twice
in fresh processes of the same environment with the same worker count: once untouched, once with ``-p`` naming a
one-line module that does ``import trl_turbo`` (pytest imports it as a plugin before it collects anything, and the
import patches TRL, exactly as a user's ``import trl_turbo`` at the top of a script does; a plugin module's asserts are
rewritten by pytest, so the plugin is that module, not the package). Nothing of trl_turbo is loaded in the stock run.
Per-test outcomes and durations come from pytest's JUnit XML; the verdict is the list of tests that pass stock and do
not pass with the import (exit status 1 when it is not empty; 2 when a run did not run: the stock run passed nothing, or
pytest exited for another reason than failing tests). Durations are compared test by test, so a slowdown can be traced
to the tests that cause it.

    git clone --depth 1 --branch v1.16.0 https://github.com/huggingface/trl /tmp/trl
    python -m trl_turbo.testing.trl_suite --trl-source /tmp/trl --ref v1.16.0 --out trl_suite.json
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

DEFAULT_PATHS = ("tests/test_grpo_trainer.py",)
PASSED, FAILED, ERROR, SKIPPED = "passed", "failed", "error", "skipped"
IMPORT_PLUGIN = "trl_suite_import_trl_turbo"  # the second run's `-p` module, written beside the extracted tests

# Written at the root of the extracted tree (above TRL's own tests/conftest.py) and loaded alike in both runs. Tests
# from a TRL ref other than the installed release may import `is_<package>_available` helpers the installed
# `trl.import_utils` lacks; this answers such names (and only names that would otherwise raise) by looking the package
# up, so version drift costs the affected tests rather than the whole file's collection.
COMPAT_CONFTEST = '''"""Written by trl_turbo.testing.trl_suite for both runs alike; see COMPAT_CONFTEST there."""
import importlib.util

import trl.import_utils as _import_utils


def _availability_helper(name):
    if name.startswith("is_") and name.endswith("_available"):
        package = name[len("is_"):-len("_available")]
        return lambda: importlib.util.find_spec(package) is not None
    raise AttributeError(f"module 'trl.import_utils' has no attribute {name!r}")


if "__getattr__" not in vars(_import_utils):
    _import_utils.__getattr__ = _availability_helper
'''


def _git(source: Path, *args: str) -> bytes:
    git_dir = source / ".git" if (source / ".git").exists() else source
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True).stdout


def extract_tests(source: str | Path, ref: str, dest: str | Path) -> str:
    """Extract ``tests/`` and ``pyproject.toml`` (pytest's markers) of ``source`` at ``ref`` into ``dest``; return
    the TRL version that ref declares (its ``VERSION`` file, or "unknown")."""
    source, dest = Path(source), Path(dest)
    try:
        commit = _git(source, "rev-parse", "--verify", f"{ref}^{{commit}}").decode().strip()
    except subprocess.CalledProcessError as error:
        raise SystemExit(f"trl_suite: {ref!r} is not a commit of {source}: {error.stderr.decode().strip()}") from None
    archive = _git(source, "archive", "--format=tar", commit, "tests", "pyproject.toml")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    (dest / "conftest.py").write_text(COMPAT_CONFTEST)
    try:
        return _git(source, "show", f"{commit}:VERSION").decode().strip()
    except subprocess.CalledProcessError:
        return "unknown"


def pytest_command(paths: list[str], junit: str | Path, *, with_import: bool, keyword: str | None = None,
                   workers: int = 1) -> list[str]:
    """The pytest command line of one run; the two runs differ only in ``-p IMPORT_PLUGIN`` (and the report path)."""
    command = [sys.executable, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    if with_import:
        command += ["-p", IMPORT_PLUGIN]
    if keyword:
        command += ["-k", keyword]
    if workers > 1:
        command += ["-n", str(workers)]
    return command


def offline_env(hf_home: str | Path) -> dict[str, str]:
    """The environment of both runs: the stand-in cache as ``HF_HOME``, the Hub and data sets offline, and no
    ``TRITON_INTERPRET`` (a user's CPU run has none; with it trl_turbo runs its Triton kernels interpreted, the CPU test
    suite's choice, which made GRPO training tests 22-60x slower here)."""
    dropped = ("HF_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE", "TRITON_INTERPRET")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HUB_DISABLE_TELEMETRY="1", PYTHONDONTWRITEBYTECODE="1")
    return env


def parse_junit(path: str | Path) -> dict[str, tuple[str, float]]:
    """Test id (``module.Class::name[params]``, from the report's classname and name) -> (outcome, seconds), read from
    a pytest JUnit XML report. A test reported twice (a teardown error after its call) keeps the worse outcome."""
    rank = {PASSED: 0, SKIPPED: 1, FAILED: 2, ERROR: 3}
    results: dict[str, tuple[str, float]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        tags = {child.tag for child in case}
        outcome = (FAILED if "failure" in tags else ERROR if ERROR in tags else SKIPPED if SKIPPED in tags
                   else PASSED)
        previous, seconds = results.get(test_id, (PASSED, 0.0))
        results[test_id] = (max(previous, outcome, key=rank.get), seconds + float(case.get("time") or 0.0))
    return results


def not_run(runs: dict[str, dict]) -> list[str]:
    """Why the comparison means nothing, if it does not: a pytest exit other than 0 (all passed) or 1 (some failed),
    or a stock run that passed no test."""
    problems = [f"{name}: pytest exited with {run['returncode']}" for name, run in runs.items()
                if run["returncode"] not in (0, 1)]
    if runs["stock"]["counts"][PASSED] == 0:
        problems.append("stock: no test passed")
    return problems


def regressions(stock: dict[str, tuple[str, float]], turbo: dict[str, tuple[str, float]]) -> list[str]:
    """Tests that pass stock and do not pass with the import (missing from the second run counts as not passing)."""
    return sorted(t for t, (outcome, _) in stock.items() if outcome == PASSED and turbo.get(t, ("",))[0] != PASSED)


def counts(results: dict[str, tuple[str, float]]) -> dict[str, int]:
    tally = Counter(outcome for outcome, _ in results.values())
    return {k: tally.get(k, 0) for k in (PASSED, FAILED, ERROR, SKIPPED)}


def largest_ratios(stock: dict[str, tuple[str, float]], turbo: dict[str, tuple[str, float]], *,
                   top: int = 10, min_seconds: float = 0.5) -> list[tuple[str, float, float, float]]:
    """(test, stock s, with-import s, ratio) for the tests whose duration grew most, among those taking at least
    ``min_seconds`` one way or the other."""
    rows = [(t, s, turbo[t][1], turbo[t][1] / max(s, 1e-3)) for t, (_, s) in stock.items()
            if t in turbo and max(s, turbo[t][1]) >= min_seconds]
    return sorted(rows, key=lambda row: -row[3])[:top]


def run_twice(root: str | Path, paths: list[str], env: dict[str, str], *, keyword: str | None = None,
              workers: int = 1, log=print) -> dict[str, dict]:
    """Run ``paths`` under ``root`` stock, then with the import; per run: outcomes, counts, wall seconds, exit code."""
    runs: dict[str, dict] = {}
    plugin = Path(root) / f"{IMPORT_PLUGIN}.py"
    plugin.write_text("import trl_turbo  # noqa: F401  (patches TRL, as a user's import)\n")
    for name, with_import in (("stock", False), ("with_import", True)):
        junit = Path(root) / f"junit-{name}.xml"
        junit.unlink(missing_ok=True)  # a report left by an earlier run must not stand in for this one
        command = pytest_command(paths, junit, with_import=with_import, keyword=keyword, workers=workers)
        log(f"[trl_suite] {name}: {' '.join(command[1:])}")
        start = time.perf_counter()
        proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        (Path(root) / f"pytest-{name}.log").write_text(proc.stdout + proc.stderr)
        if not junit.exists():
            raise RuntimeError(f"pytest wrote no report ({name}, exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                               f"{proc.stderr[-3000:]}")
        results = parse_junit(junit)
        runs[name] = {"returncode": proc.returncode, "wall_s": round(wall, 1), "counts": counts(results),
                      "tests": results, "summary": (proc.stdout.strip().splitlines() or [""])[-1]}
        log(f"[trl_suite] {name}: {runs[name]['summary']} ({wall:.0f} s)")
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl-source", required=True, help="a TRL git clone or mirror (working tree or git dir)")
    parser.add_argument("--ref", default="v1.16.0", help="the TRL tag or commit whose tests run (default v1.16.0)")
    parser.add_argument("paths", nargs="*", default=list(DEFAULT_PATHS), help="test files, relative to TRL's root")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression, the same for both runs")
    parser.add_argument("--workers", type=int, default=1, help="pytest-xdist workers for both runs (needs xdist)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.workers > 1 and importlib.util.find_spec("xdist") is None:
        parser.error("--workers > 1 needs pytest-xdist, which is not installed")

    import trl

    from trl_turbo.testing.hub_standins import build_all

    with tempfile.TemporaryDirectory(prefix="trl-suite-") as root:
        ref_version = extract_tests(args.trl_source, args.ref, root)
        if ref_version != trl.__version__:
            print(f"[trl_suite] note: the tests are TRL {ref_version}'s, the installed TRL is {trl.__version__}")
        standins = build_all(Path(root) / "hf_home")
        runs = run_twice(root, args.paths, offline_env(Path(root) / "hf_home"), keyword=args.keyword,
                         workers=args.workers)
        if args.out:  # the logs say why a test failed; the temporary directory goes
            for name in runs:
                shutil.copy(Path(root) / f"pytest-{name}.log", Path(args.out).with_suffix(f".{name}.log"))
    stock, turbo = runs["stock"]["tests"], runs["with_import"]["tests"]
    lost = regressions(stock, turbo)
    fixed = sorted(t for t, (o, _) in turbo.items() if o == PASSED and stock.get(t, ("",))[0] != PASSED)
    ratios = largest_ratios(stock, turbo)
    for name in runs:
        durations = sum(s for _, s in runs[name]["tests"].values())
        print(f"{name:12s} {runs[name]['counts']}  wall {runs[name]['wall_s']:.0f} s  sum of test times "
              f"{durations:.0f} s")
    print(f"wall ratio (with import / stock): {runs['with_import']['wall_s'] / max(runs['stock']['wall_s'], 1e-9):.2f}")
    print("largest per-test ratios (stock s, with-import s):")
    for test, a, b, ratio in ratios:
        print(f"  {ratio:5.2f}x  {a:7.2f} {b:7.2f}  {test}")
    print(f"passed stock, not with the import: {len(lost)}")
    for test in lost:
        print(f"  {test}: {turbo.get(test, ('missing',))[0]}")
    problems = not_run(runs)
    for problem in problems:
        print(f"[trl_suite] did not run: {problem}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "trl_source": str(args.trl_source), "ref": args.ref, "ref_version": ref_version,
            "installed_trl": trl.__version__, "paths": args.paths, "keyword": args.keyword, "workers": args.workers,
            "standins": standins, "regressions": lost, "fixed_by_import": fixed, "not_run": problems,
            "largest_ratios": [{"test": t, "stock_s": a, "with_import_s": b, "ratio": r} for t, a, b, r in ratios],
            "runs": {name: {**run, "tests": {t: {"outcome": o, "seconds": s} for t, (o, s) in run["tests"].items()}}
                     for name, run in runs.items()},
        }, indent=1))
    return 2 if problems else 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
