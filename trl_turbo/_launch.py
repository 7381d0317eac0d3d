"""Entry point that `trl-turbo <command>` hands to `accelerate launch`: patch TRL, then run `trl.scripts.<command>`
as `__main__`, exactly as `trl <command>` would."""

import runpy
import sys

import trl_turbo  # noqa: F401  (patches TRL in this training process)

if __name__ == "__main__":
    command = sys.argv.pop(1)
    sys.argv[0] = f"trl {command}"
    runpy.run_module(f"trl.scripts.{command}", run_name="__main__", alter_sys=True)
