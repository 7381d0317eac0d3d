"""The engine-options benchmark's pure parts: each option's precision, the byte floor of a decode step, greedy
agreement, and the refusals that come before any GPU work (the measurements run on the GPU)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from trl_turbo.bench import engine_options
from trl_turbo.bench.engine_options import OPTIONS, agreement, chosen, step_floor_s
from trl_turbo.bench.roofline import shape_spec


def test_every_candidate_names_a_reference_of_its_own_precision():
    for name, option in OPTIONS.items():
        if option.reference is not None:
            reference = OPTIONS[option.reference]
            assert reference.reference is None, name
            assert reference.weight_dtype == option.weight_dtype, name
    assert OPTIONS["fp8"].kv_bytes == 1 and OPTIONS["fp8-bf16-kv"].kv_bytes == 2 and OPTIONS["bf16"].kv_bytes == 2
    assert OPTIONS["fp8-turbo-gemm"].requests == ("fp8-gemm",) and not OPTIONS["fp8"].requests
    from trl_turbo.bench.engine_requests import REQUESTS

    assert all(set(option.requests) <= set(REQUESTS) for option in OPTIONS.values())


def test_a_decode_steps_floor_is_its_weights_and_its_live_kv_cache_at_the_read_bandwidth():
    spec = shape_spec("llama-3.1-8b", None)
    lm_head = spec.vocab_size * spec.hidden_size * 2
    kv_per_token = spec.layers * spec.key_value_heads * spec.head_dim * 2  # keys and values, one byte each in fp8
    bandwidth = 4e12
    # 8 sequences of 100 prompt tokens, 64 sampled, the last 32 steps measured (32..63 tokens sampled): on average
    # 147.5 cached tokens each
    expected = (spec.layer_linear_parameters * 1 + lm_head + 8 * 147.5 * kv_per_token) / bandwidth
    assert step_floor_s(spec, OPTIONS["fp8"], 8, 100, 64, bandwidth) == pytest.approx(expected)
    bf16 = (spec.layer_linear_parameters * 2 + lm_head + 8 * 147.5 * kv_per_token * 2) / bandwidth
    assert step_floor_s(spec, OPTIONS["bf16"], 8, 100, 64, bandwidth) == pytest.approx(bf16)


def test_agreement_counts_equal_tokens_and_compares_log_probs_only_before_each_divergence():
    reference = [{"tokens": [1, 2, 3, 4], "logprobs": [-0.1, -0.2, -0.3, -0.4]},
                 {"tokens": [5, 6, 7, 8], "logprobs": [-1.0, -1.0, -1.0, -1.0]}]
    samples = [{"tokens": [1, 2, 9, 4], "logprobs": [-0.1, -0.25, -5.0, -0.4]},
               {"tokens": [5, 6, 7, 8], "logprobs": [-1.0, -1.0, -1.0, -1.01]}]
    result = agreement(samples, reference)
    assert result["tokens_equal"] == 7 and result["tokens"] == 8
    assert result["first_divergence"] == [2, 4]
    assert result["max_logprob_gap_before_divergence"] == pytest.approx(0.05)  # not the -5.0 after divergence


def test_a_completions_log_probs_are_read_at_its_chosen_tokens():
    completion = SimpleNamespace(token_ids=[7, 3], logprobs=[{7: SimpleNamespace(logprob=-0.5)},
                                                             {3: SimpleNamespace(logprob=-1.5)}])
    assert chosen(completion) == {"tokens": [7, 3], "logprobs": [-0.5, -1.5]}


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    engine_options.add_parser(parser.add_subparsers())
    return parser.parse_args(["engine-options", *argv])


def test_unknown_options_and_missing_references_are_refused_before_any_gpu_work():
    with pytest.raises(SystemExit, match="unknown options"):
        engine_options.run(_args("--options", "bf16,fp9"))
    with pytest.raises(SystemExit, match="checked against 'fp8'"):
        engine_options.run(_args("--options", "fp8-marlin"))


def test_the_file_is_rewritten_after_each_engine_so_a_command_cut_short_keeps_its_rows(monkeypatch, tmp_path):
    import json

    import torch

    from trl_turbo.bench import e2e, hardware, results

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(e2e, "prepare_checkpoint", lambda *args: None)
    monkeypatch.setattr(hardware, "measure_apart", lambda device: {"read_bytes_per_s": 4e12})
    monkeypatch.setattr(results, "metadata", lambda benchmark, device, config: {"benchmark": benchmark})
    greedy = [{"tokens": [1, 2], "logprobs": [-0.5, -0.5]}]
    cell = {"batch": 8, "context": 16, "ms_per_step": 5.0}
    written = []

    def one_engine(module, jobs, gpus, timeout):
        assert len(jobs) == 1  # one engine a job
        files = list(tmp_path.glob("engine-options-*.json"))
        written.append([row["name"] for row in json.loads(files[0].read_text())["rows"]] if files else [])
        if jobs[0]["name"] == "bf16-turbo-attention":
            raise KeyboardInterrupt  # the command's time ran out during the second engine
        return [{"ok": True, "greedy": greedy, "cells": [dict(cell)]}]

    monkeypatch.setattr(engine_options, "run_jobs", one_engine)
    with pytest.raises(KeyboardInterrupt):
        engine_options.run(_args("--options", "bf16,bf16-turbo-attention", "--out", str(tmp_path)))
    assert written == [[], ["bf16"]]
    (path,) = tmp_path.glob("engine-options-*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert row["name"] == "bf16" and row["cells"][0]["over_floor"] == pytest.approx(5.0 / row["cells"][0]["floor_ms"])


def test_a_candidates_agreement_is_filled_in_once_its_reference_has_run():
    spec = shape_spec("llama-3.1-8b", None)
    greedy = [{"tokens": [1, 2], "logprobs": [-0.5, -0.5]}]
    rows = [{"name": "bf16-turbo-attention", "ok": True, "greedy": greedy, "cells": []}]
    engine_options.finish_rows(rows, spec, 128, 4e12)
    assert "agreement" not in rows[0]
    rows.append({"name": "bf16", "ok": True, "greedy": greedy, "cells": []})
    engine_options.finish_rows(rows, spec, 128, 4e12)
    assert rows[0]["agreement"]["tokens_equal"] == 2 and "agreement" not in rows[1]


def test_a_real_models_greedy_prompts_are_text_and_a_random_ones_token_ids():
    text = engine_options.greedy_prompts(True)
    assert len(text) == engine_options.GREEDY_PROMPTS and all(isinstance(p, str) and p for p in text)
    ids = engine_options.greedy_prompts(False)
    assert len(ids) == engine_options.GREEDY_PROMPTS and all(len(p["prompt_token_ids"]) == 16 for p in ids)
    assert engine_options.greedy_prompts(False) == ids  # the same on every run: two engines compare token by token
