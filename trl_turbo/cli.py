"""`trl-turbo`: TRL's own command line, with trl_turbo patched in every process it starts.

Design: TRL's CLI parses the arguments (with GRPOConfig already carrying the `turbo_*` fields, because importing
this module imports trl_turbo) and then starts `trl/scripts/<command>.py` through `accelerate launch`. That child
process would not import trl_turbo, so the launcher is pointed at `trl_turbo/_launch.py`, which patches TRL and then
runs TRL's script unchanged. Everything else — argument names, YAML configs, accelerate configs — is TRL's.

`trl-turbo plan` is trl_turbo's own command: the memory forecast of `trl_turbo.planning` for a `trl grpo` YAML.
"""

from __future__ import annotations

import sys
from importlib import resources
from typing import Any

import trl_turbo  # noqa: F401  (patches TRL, adds the GRPOConfig fields)
from trl_turbo import registry

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


def plan_main(argv: list[str]) -> int:
    """`trl-turbo plan --config grpo.yaml [--model M] [--gpu-gib G] ...`: print the forecast; exit 1 if it does not
    fit, 2 on bad input."""
    import argparse

    from trl_turbo.planning import plan

    parser = argparse.ArgumentParser(
        prog="trl-turbo plan",
        description="Forecast a GRPO run's device and host memory per phase (start-up, generation, training) for "
        "trl_turbo and stock TRL, without loading weights.")
    parser.add_argument("--config", help="the run's YAML (as `trl grpo --config` takes it)")
    parser.add_argument("--model", help="bench shape name, local directory or config.json, or hub id "
                        "(default: the config's model_name_or_path)")
    parser.add_argument("--gpu-gib", type=float, help="device memory to plan for (default: this machine's GPU)")
    parser.add_argument("--host-gib", type=float, help="host memory to plan for (default: what is available here)")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="prompt tokens per sequence (default 256)")
    parser.add_argument("--completion-tokens", type=int,
                        help="completion tokens per sequence (default: the config's max_completion_length)")
    parser.add_argument("--processes", type=int, default=1,
                        help="GPUs of one node under TRL's fsdp2.yaml (default 1); the forecast is per GPU")
    parser.add_argument("--tp", type=int, help="vLLM's tensor-parallel size (default: the config's)")
    options = parser.parse_args(argv)
    fields = {} if options.tp is None else {"vllm_tensor_parallel_size": options.tp}
    try:
        forecast = plan(options.config, options.model, gpu_gib=options.gpu_gib, host_gib=options.host_gib,
                        prompt_tokens=options.prompt_tokens, completion_tokens=options.completion_tokens,
                        processes=options.processes, **fields)
    except (ValueError, OSError, KeyError) as exc:
        print(f"trl-turbo plan: {exc}", file=sys.stderr)
        return 2
    print(forecast)
    return 0 if forecast.turbo.fits else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:
        return plan_main(argv[1:])
    import trl.cli.accelerate_launcher as accelerate_launcher
    from trl.cli.main import main as trl_main

    # Only for this command (a scoped registry patch): `trl.cli.commands.training` imports the launcher at call time.
    with registry.scoped(accelerate_launcher, "launch_training_script", launch_training_script_with_turbo):
        return trl_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
