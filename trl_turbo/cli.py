"""`trl-turbo`: TRL's own command line, with trl_turbo patched in every process it starts.

Design: TRL's CLI parses the arguments (with GRPOConfig already carrying the `turbo_*` fields, because importing
this module imports trl_turbo) and then starts `trl/scripts/<command>.py` through `accelerate launch`. That child
process would not import trl_turbo, so the launcher is pointed at `trl_turbo/_launch.py`, which patches TRL and then
runs TRL's script unchanged. Everything else — argument names, YAML configs, accelerate configs — is TRL's.
"""

from __future__ import annotations

import sys
from importlib import resources
from typing import Any

import trl_turbo  # noqa: F401  (patches TRL, adds the GRPOConfig fields)

LAUNCH_SHIM = resources.files("trl_turbo").joinpath("_launch.py")


def launch_training_script_with_turbo(
    script_name: str, launch_args: list[str], training_script_args: list[str], **kwargs: Any
) -> None:
    """Drop-in for `trl.cli.accelerate_launcher.launch_training_script` that launches through `_launch.py`."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    launch_command_fn = kwargs.get("launch_command_fn", launch_command)
    launch_parser_fn = kwargs.get("launch_parser_fn", launch_command_parser)
    script = script_name.removesuffix(".py")
    accelerate_args = launch_parser_fn().parse_args(launch_args + [str(LAUNCH_SHIM), script] + training_script_args)
    launch_command_fn(accelerate_args)


def main(argv: list[str] | None = None) -> int:
    import trl.cli.accelerate_launcher as accelerate_launcher
    from trl.cli.main import main as trl_main

    # Process-local and only for this command: `trl.cli.commands.training` imports the launcher at call time.
    accelerate_launcher.launch_training_script = launch_training_script_with_turbo
    return trl_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    raise SystemExit(main())
