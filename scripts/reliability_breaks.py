"""Show that each reliability test of issue #20 fails on a deliberately broken trl_turbo.

Design decision: a test that cannot fail proves nothing, so each break here is a small, plausible regression of the
behaviour one test guards, applied as an exact text replacement to a throwaway git worktree of HEAD (never to the
checkout you work in). A replacement whose source text is gone (the code moved on) stops the script loudly instead of
testing nothing. Each test first runs on the unbroken worktree and must pass (exit 0); with its break it must fail
(exit 1: failing tests, not a collection error or a missing test id).

    python scripts/reliability_breaks.py            # all breaks, about 5 minutes on 2 CPU cores
    python scripts/reliability_breaks.py resume     # one by name
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Break:
    name: str
    what: str
    path: str
    replacements: tuple[tuple[str, str], ...]
    test: str
    appended: str = ""


LOSS_CALL_COUNT = '''

_calls = [0]  # BREAK: process-global state that no checkpoint holds


def _count_scaled_loss(self, model, inputs):
    _calls[0] += 1
    groups = sequence_groups(self, inputs)
    loss = (loss_step.compute_loss(self, model, inputs) if groups is None
            else loss_step.grouped_compute_loss(self, model, inputs, groups))
    return loss * (1 + 0.05 * _calls[0])
'''

BREAKS = (
    Break("resume", "the fused loss is scaled by a process-wide call count, state a checkpoint does not carry",
          "trl_turbo/patches/trl_trainer.py",
          (("    def _compute_loss(self, model, inputs):\n        if not fused_loss_enabled(self):",
            "    def _compute_loss(self, model, inputs):\n        return _count_scaled_loss(self, model, inputs)\n"
            "        if not fused_loss_enabled(self):"),),
          "tests/integration/test_resume.py", appended=LOSS_CALL_COUNT),
    Break("interruption", "merged sampling restores the base weights only when generation returns normally",
          "trl_turbo/vllm/merge.py",
          (("        try:\n            self.merge()\n            yield\n        finally:\n            self.restore()\n",
            "        self.merge()\n        yield\n        self.restore()\n"),),
          "tests/sampler/test_vllm_merge.py"),
    Break("soak", "the soak verdict ignores host RSS growth",
          "trl_turbo/bench/soak.py",
          (('check("host_rss_growth", rss[-1] - rss[0],', 'check("host_rss_growth", 0,'),
           ('check("host_rss_slope", _slope(rss),', 'check("host_rss_slope", 0,')),
          "tests/bench/test_soak.py"),
    Break("host-memory", "a failed pinned allocation raises instead of falling back to pageable memory",
          "trl_turbo/offload/pinned_pool.py",
          (("            except RuntimeError as error:  # out of page-lockable memory: pageable still works, with "
            "blocking copies\n",
            "            except RuntimeError as error:  # out of page-lockable memory: pageable still works, with "
            "blocking copies\n                raise\n"),),
          "tests/offload/test_pinned_pool.py"),
    Break("no-cost", "without a CUDA device the memory plan measures its layers through saved-tensor hooks",
          "trl_turbo/offload/memory_plan.py",
          (("        if budget is None:  # no device to plan for", "        if False:  # no device to plan for"),
           ("        free, allocated, margin = budget\n",
            "        free, allocated, margin = budget if budget is not None else (1 << 40, 0, 0)\n")),
          "tests/offload/test_memory_plan.py::test_planned_layers_without_a_device_keep_everything_as_plain_autograd"),
    Break("trl-suite", "the harness's second run does not import trl_turbo",
          "trl_turbo/testing/trl_suite.py",
          (('.write_text("import trl_turbo  # noqa: F401  (patches TRL, as a user\'s import)\\n")',
            '.write_text("pass\\n")'),),
          "tests/testing/test_trl_suite.py"),
)


def apply(worktree: Path, item: Break) -> None:
    source = worktree / item.path
    text = source.read_text()
    for old, new in item.replacements:
        if text.count(old) != 1:
            raise SystemExit(f"{item.name}: the text to break is not in {item.path} exactly once; update this script")
        text = text.replace(old, new)
    source.write_text(text + item.appended)


def run_test(worktree: Path, test: str) -> tuple[int, str, float]:
    """pytest's exit status on `test` in `worktree`, its first error line and the seconds it took."""
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(worktree)}  # child processes import the worktree's copy too
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test],
                            cwd=worktree, env=env, capture_output=True, text=True)
    errors = [line[1:].strip() for line in result.stdout.splitlines() if line.startswith("E ")]
    summary = errors[0] if errors else result.stdout.strip()[-200:]
    return result.returncode, summary, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"breaks to run (default all): {', '.join(b.name for b in BREAKS)}")
    args = parser.parse_args()
    chosen = [b for b in BREAKS if not args.names or b.name in args.names]
    all_caught = True
    with tempfile.TemporaryDirectory() as parent:
        worktree = Path(parent) / "broken"
        try:
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(worktree), "HEAD"],
                           check=True)
            for item in chosen:
                subprocess.run(["git", "-C", str(worktree), "checkout", "-q", "--", "."], check=True)
                clean_status, clean_summary, _ = run_test(worktree, item.test)
                if clean_status != 0:
                    all_caught = False
                    print(f"{item.name}: {item.test} does not pass unbroken (exit {clean_status}): {clean_summary}")
                    continue
                apply(worktree, item)
                status, summary, seconds = run_test(worktree, item.test)
                caught = status == 1
                all_caught &= caught
                verdict = "caught" if caught else f"NOT CAUGHT (exit {status})"
                print(f"{item.name}: {verdict} by {item.test} ({seconds:.0f} s) -- break: {item.what}\n"
                      f"    {summary[:200]}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)], check=False)
            subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], check=False)
    return 0 if all_caught else 1


if __name__ == "__main__":
    raise SystemExit(main())
