"""Entry point that `trl-turbo <command>` hands to `accelerate launch`: patch TRL, then run `trl.scripts.<command>`
as `__main__`, exactly as `trl <command>` would."""

import os
import sys

# Run as a script, this file's folder would lead sys.path and trl_turbo's subpackages (`vllm`, `kernels`) would
# shadow the real top-level libraries of the same names.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

import runpy  # noqa: E402

import trl_turbo  # noqa: E402,F401  (patches TRL in this training process)

if __name__ == "__main__":
    command = sys.argv.pop(1)
    sys.argv[0] = f"trl {command}"
    runpy.run_module(f"trl.scripts.{command}", run_name="__main__", alter_sys=True)
