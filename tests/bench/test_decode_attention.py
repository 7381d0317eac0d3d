"""The decode-attention benchmark's pure parts: a step's byte floor and the cuts its sweep tries (the timings run on
the GPU)."""

from __future__ import annotations

import pytest

from trl_turbo.bench import __main__ as bench_main
from trl_turbo.bench.decode_attention import SWEEP_BLOCK_N, SWEEP_STAGES, SWEEP_WARPS, step_bytes, sweep_configs
from trl_turbo.kernels.paged_decode_attention import run_length


def test_a_steps_floor_is_every_live_key_and_value_once_plus_the_query_in_and_out():
    one = step_bytes(64, 1984, 32, 8, 128, 1, 1)
    assert one == 64 * (2 * 1984 * 8 * 128 + 3 * 32 * 128)  # an e4m3 query in, a bf16 output out
    # bf16 doubles the cache and the query's bytes
    assert step_bytes(64, 1984, 32, 8, 128, 2, 1) - one == 64 * (2 * 1984 * 8 * 128 + 32 * 128)
    assert step_bytes(64, 1984, 32, 8, 128, 1, 32) == 32 * one


@pytest.mark.parametrize("context", [16, 130, 1984])
def test_the_sweep_cuts_whole_tiles_into_runs_that_cover_the_context_none_empty(context):
    configs = sweep_configs(context)
    assert len(set(configs)) == len(configs) and configs == sweep_configs(context)  # the same order every run
    for block_n, _, _, runs, _ in configs:
        length = run_length(context, runs, block_n)
        assert length % block_n == 0 and block_n % 16 == 0
        assert runs * length >= context and (runs - 1) * length < context
    assert {config.block_n for config in configs} == {16, 32, 64, 128}
    assert not any(config.fp8_scores for config in configs)  # a 16-bit cell: no e4m3 scores
    fp8 = sweep_configs(context, fp8=True)
    assert {config._replace(fp8_scores=False) for config in fp8} == set(configs)  # each cut with and without them
    assert len(fp8) == 2 * len(configs)
    most_runs = max(config.runs for config in configs)
    assert most_runs == (1 if context <= 16 else min(16, -(-context // 16)))


@pytest.mark.parametrize(("context", "runs_first"), [(1984, 9), (512, 9), (16, 2)])
def test_every_tiling_at_the_default_cuts_run_count_is_swept_first(context, runs_first):
    """First every (tile, warps, stages) at the runs the default's count fills at this context (a context shorter
    than the engine's longest fills fewer), then the other counts."""
    configs = sweep_configs(context, runs_first=runs_first)
    tilings = len(SWEEP_BLOCK_N) * len(SWEEP_WARPS) * len(SWEEP_STAGES)
    default = [config.runs == -(-context // run_length(context, runs_first, config.block_n)) for config in configs]
    assert default == [True] * tilings + [False] * (len(configs) - tilings)
    assert len({(c.block_n, c.warps, c.stages) for c in configs[:tilings]}) == tilings
    assert len({config.runs for config in configs}) > 1 or context <= 16


def test_the_command_is_registered(capsys):
    with pytest.raises(SystemExit):
        bench_main.main(["decode-attention", "--help"])
    assert "--max-model-len" in capsys.readouterr().out


def test_explicit_cuts_are_parsed_and_named_as_the_command_spells_them():
    from trl_turbo.bench.decode_attention import cut_name, parse_cuts
    from trl_turbo.kernels.paged_decode_attention import DecodeAttentionConfig

    cuts = parse_cuts("32/2/2/1, 64/2/3/2/e4m3")
    assert cuts == (DecodeAttentionConfig(32, 2, 2, 1), DecodeAttentionConfig(64, 2, 3, 2, True))
    assert [cut_name(cut) for cut in cuts] == ["32/2/2/1", "64/2/3/2/e4m3"]
    assert parse_cuts(None) == parse_cuts("") == ()
    for bad in ("32/2/2", "32/2/2/1/bf16", "32/two/2/1", "32/2/2/1/e4m3/x"):
        with pytest.raises(SystemExit, match="TILE/WARPS/STAGES/RUNS"):
            parse_cuts(bad)
    with pytest.raises(SystemExit, match="TILE/WARPS/STAGES/RUNS"):  # before any GPU work
        bench_main.main(["decode-attention", "--cuts", "32/2"])
