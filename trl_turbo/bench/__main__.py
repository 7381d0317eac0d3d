"""CLI entry point: ``python -m trl_turbo.bench <benchmark> ...`` (train, loss, e2e, engine-options, decode-gemm,
decode-attention, curves, is-gap, roofline, cpu-step, soak, pinning, table).

Design decision: one argparse program with a subcommand per benchmark; each subcommand module owns its arguments
(``add_parser``) and its ``run``, so adding a benchmark touches only its module and this list.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from . import (
    cpu_step,
    curves,
    decode_attention,
    decode_gemm,
    e2e,
    engine_options,
    is_gap,
    loss,
    pinning,
    results,
    roofline,
    soak,
    train,
)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trl_turbo.bench", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    train.add_parser(subparsers)
    loss.add_parser(subparsers)
    e2e.add_parser(subparsers)
    engine_options.add_parser(subparsers)
    decode_gemm.add_parser(subparsers)
    decode_attention.add_parser(subparsers)
    curves.add_parser(subparsers)
    is_gap.add_parser(subparsers)
    roofline.add_parser(subparsers)
    cpu_step.add_parser(subparsers)
    soak.add_parser(subparsers)
    pinning.add_parser(subparsers)
    results.add_table_parser(subparsers)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
