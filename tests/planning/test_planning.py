"""The memory forecast (`trl_turbo.planning`, `trl-turbo plan`): against every committed GPU measurement of the
current code, and its command line on the shipped config. No GPU and no weights: models are counted on the meta
device."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
from transformers import AutoConfig

from trl_turbo.bench.peers import is_peer
from trl_turbo.cli import main as cli_main
from trl_turbo.families import POST_MLP_NORM_MODEL_TYPES
from trl_turbo.planning import plan
from trl_turbo.planning.model_spec import load_config, model_spec
from trl_turbo.planning.run import forecast_run
from trl_turbo.planning.training import MicroBatch, forecast_training
from trl_turbo.vllm.kv_budget import auto_kv_cache_bytes, useful_kv_cache_bytes

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
EXAMPLE = ROOT / "examples" / "grpo_llama8b.yaml"
# Rows measured with the memory plan's standby ceiling (2026-11-25 01:00 on; later ones also with the 4096-token
# group floor and the small-device margin, which change none of these rows' plans); earlier rows measured other plans.
CURRENT_FROM = "2026-11-25T01:00"
# "auto" keeps layers' activations as `offload.lean_activations` stores them, and picks sequence groups by their
# priced cost, from this date on: its earlier rows measured layers that stored about 1.7x as much.
AUTO_CURRENT_FROM = "2026-11-25T16:00"
# Layers with a post-MLP norm (gemma2) reserve twice their plain bytes for the recompute in rows from this date on
POST_MLP_NORM_AUTO_CURRENT_FROM = "2026-11-26T10:35"
# The automatic KV budget counts each sequence's pages (`kv_budget.useful_kv_cache_bytes`) from this date on; rows
# measured before it were sized 10% over every sequence's tokens, and are checked against the forecast with that rule.
KV_PAGES_FROM = "2026-11-28T14:00"
CAPACITY = {"NVIDIA H200": 143771 * 2**20, "NVIDIA H100 80GB HBM3": 81559 * 2**20}
TOLERANCE = 0.10
MODES = {"stock": "off", "turbo": "auto", "turbo-min": "min"}


def _budget_rule_of(result: dict, monkeypatch) -> None:
    """The KV budget rule `result` was measured with, for the forecast of its rows: today's, or for rows measured
    before it, 10% over every sequence's tokens."""
    from trl_turbo.planning import run

    def tokens_with_headroom(*, max_num_seqs, seq_len, max_model_len, per_token_bytes):
        return int(max(1.1 * max_num_seqs * min(seq_len, max_model_len), max_model_len) * per_token_bytes)

    monkeypatch.setattr(run, "useful_kv_cache_bytes",
                        tokens_with_headroom if result["date"] < KV_PAGES_FROM else useful_kv_cache_bytes)


def _results(kind: str) -> list[dict]:
    files = [{**json.loads(path.read_text()), "stem": path.stem} for path in sorted(RESULTS.glob(f"{kind}-*.json"))]
    return [result for result in files if result["date"] >= CURRENT_FROM]


def _spec(config: dict):
    params = dict(config["model_config"])
    return model_spec(AutoConfig.for_model(params.pop("model_type"), **params), (config["lora"] or {}).get("r"))


def test_training_peaks_match_every_current_bench_train_row():
    checked, misses, auto = 0, [], 0
    for result in _results("train"):
        if result["config"].get("launch", "1gpu") != "1gpu":  # per GPU under a launch: the next test
            continue
        spec = _spec(result["config"])
        for row in result["rows"]:
            if not row["ok"] or row["variant"] not in MODES:
                continue
            if MODES[row["variant"]] == "auto" and result["date"] < AUTO_CURRENT_FROM:
                continue
            if (MODES[row["variant"]] == "auto" and spec.model_type in POST_MLP_NORM_MODEL_TYPES
                    and result["date"] < POST_MLP_NORM_AUTO_CURRENT_FROM):
                continue
            quantized = row["quantization"] == "nf4"
            turbo_set = result["config"].get("turbo_set") or {}  # `bench train --turbo-set` fields
            assert set(turbo_set) <= {"turbo_training_memory_gib", "turbo_tiled_mlp_tokens"}, turbo_set  # modelled
            ceiling = turbo_set.get("turbo_training_memory_gib")
            forecast = forecast_training(
                spec, MicroBatch(row["micro_batch"], row["prompt_len"] + row["completion_len"]),
                mode=MODES[row["variant"]], capacity_bytes=CAPACITY[result["gpu"]],
                static_bytes=spec.weight_bytes(quantized) + 4 * spec.lora_parameters, quantized_4bit=quantized,
                forward_token_budget=result["config"].get("forward_token_budget") or 32768,
                tiled_mlp_tokens=turbo_set.get("turbo_tiled_mlp_tokens", 16384),
                ceiling_bytes=None if ceiling is None else int(ceiling * 2**30))
            error = forecast.peak_bytes / 2**30 / row["peak_gib"] - 1
            checked += 1
            auto += MODES[row["variant"]] == "auto"
            if abs(error) > TOLERANCE:
                misses.append((result["date"], row["variant"], row["completion_len"], f"{error:+.1%}"))
    assert checked >= 25, checked  # llama 16-bit and 4-bit, gemma2, both GPUs, all three modes
    assert auto >= 2, auto  # Llama-3.1-8B 16 x 2112 and 8 x 2304 on the H200, every layer kept
    assert not misses, misses


def test_per_gpu_training_forecast_matches_the_launched_bench_train_rows(monkeypatch):
    """`bench train --launch fsdp2` against `trl-turbo plan --processes N` without vLLM: per GPU, FSDP2's shard of
    the weights, its gathered layers and the micro-batch's activations."""
    checked = 0
    for result in _results("train"):
        config = result["config"]
        if config.get("launch", "1gpu") == "1gpu":
            continue
        spec = _spec(config)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(config["processes"]))
        for row in result["rows"]:
            if not row["ok"]:
                continue
            args = types.SimpleNamespace(use_vllm=False, per_device_train_batch_size=config["micro_batch_per_gpu"],
                                         steps_per_generation=1, max_completion_length=row["completion_len"],
                                         world_size=config["processes"], fsdp="full_shard",
                                         fsdp_config={"version": 2}, gradient_checkpointing=True,
                                         **config["variant_config"][row["variant"]])
            forecast = forecast_run(args, spec, capacity_bytes=CAPACITY[result["gpu"]],
                                    prompt_tokens=config["prompt_len"], stock=row["variant"] == "stock")
            miss = abs(forecast.peak_bytes / 2**30 / row["peak_gib"] - 1)
            if (result["stem"], row["variant"]) in KNOWN_MISSES:
                assert TOLERANCE < miss <= KNOWN_MISSES[result["stem"], row["variant"]], (result["stem"], miss)
            else:
                assert miss <= TOLERANCE, (result["stem"], row["variant"], miss)
            checked += 1
    assert checked >= 2, checked


# Rows the forecast is known to miss by more than TOLERANCE, with why; they must stay within KNOWN_MISS_TOLERANCE and
# outside TOLERANCE (an entry to delete once the forecast covers the row). Under FSDP2 a rank's device holds the
# root's parameters whole from the root's forward to the end of its backward (embedding, LM head: 2.9 GiB at the
# Qwen2.5-32B shape); counted, stock's 32B e2e row (rank 0 held 4.7 GiB more than rank 1 from start-up on) and the
# 32B `bench train` rows, "min" at 8 x 8448 and 8 x 33024 tokens per GPU, are within TOLERANCE.
# Turbo's 1 x 8 x 4096 row peaks in its training phase (24.2 GiB, over its 21.2 GiB generation): the run's planner
# took two groups of four sequences, priced faster, whose plan (24.7-25.5 GiB predicted) overran its standby ceiling;
# the forecast plans four groups of two under it (21.6 GiB). The planner now prefers a split that fits
# (`fastest_group_rows`), yet the same row run again with it (…-042956, one step) peaked at 24.2 GiB with every layer
# offloaded and 24.7 GiB predicted: a single step's one micro-batch is planned before anything was measured, so it
# takes the token budget's groups (the run's first micro-batch is now priced from the model's hidden size).
# Stock's 8B FSDP2 + TP=2 row under transformers 5.24 (…-071822) peaks on rank 0 at 58.3 GiB, 4.6 GiB over rank 1,
# and again in the same command run later (…-124126); rank 0's extra is not modelled.
KNOWN_MISS_TOLERANCE = 0.15
KNOWN_MISSES = dict.fromkeys([("e2e-llama-3.1-8b-20261128-012724", "turbo"),
                              ("e2e-llama-3.1-8b-20261128-042956", "turbo"),
                              ("e2e-llama-3.1-8b-realistic-2gpu-tp2-20261128-071822", "stock"),
                              ("e2e-llama-3.1-8b-realistic-2gpu-tp2-20261128-124126", "stock")], KNOWN_MISS_TOLERANCE)
# Four ranks, FSDP2 + TP=4 (4 x H200): turbo's training phase holds far more than forecast (Llama-3.1-8B 15.4 GiB
# against 6.4): the run trained one forward of 8 sequences, every layer offloaded (its first forward measured nothing
# and the planner then never priced smaller groups; it now prices them from its prior), where the forecast plans four
# of two; and the driver counted about 3.6 GiB more than torch allocated, which the forecast's context leaves out: a
# 51% miss. The 70B row's peak (72.9 GiB) came before its first step, while accelerate's loading held FSDP2's new
# shards beside the engine's weights (a 43% miss): shards are now written into the engine as they load
# (`ShardedShare.loading_in_place`), not yet measured.
# The 32B `bench train` row under a 55 GiB ceiling ("auto", 8 x 8448 tokens per GPU; …-094303) peaked at 48.2 GiB,
# 12.8% under the forecast, which plans up to the ceiling: the run's first micro-batch peaked 8 GiB over its own
# prediction (40.2 GiB), and every later plan kept that excess in reserve, so it held fewer layers on the device.
KNOWN_MISSES[("train-qwen2.5-32b-2gpu-fsdp2-20261129-094303", "turbo")] = KNOWN_MISS_TOLERANCE
# The same shape under "min" in one forward of 8 x 8448 tokens (`--forward-token-budget 131072`; …-134951): torch
# allocated at most 49.8 GiB, under the 53.9 GiB forecast, but reserved 67.4 GiB and the driver counted 69.6: the
# caching allocator held 17.6 GiB of free blocks among the 0.7-0.9 GiB tensors of a 67584-token forward (6.8 GiB in
# the same command's default split into three groups, …-134227, within TOLERANCE). The forecast does not model
# torch's cache.
KNOWN_MISSES[("train-qwen2.5-32b-2gpu-fsdp2-20261129-134951", "turbo-min")] = 0.25
KNOWN_MISSES[("e2e-llama-3.3-70b-4gpu-tp4-cap79.1gib-20261128-160231", "turbo")] = 0.45
KNOWN_MISSES[("e2e-llama-3.1-8b-4gpu-tp4-20261128-155807", "turbo")] = 0.55
# The 70B row again with in-place loading: no start-up peak, but its first micro-batch still ran as one forward (no
# forward had been planned when it was split; now priced from the model's hidden size), and the caching allocator
# kept those blocks for the second step, whose groups of two held 44.9 GiB of torch's (44.1 GiB forecast for the
# training phase): 53.5 GiB against 44.6 GiB forecast. Its four-prompt row, whose peak is generation, is within
# TOLERANCE.
KNOWN_MISSES[("e2e-llama-3.3-70b-4gpu-tp4-cap79.1gib-20261128-200224", "turbo")] = 0.25
# Full fine-tuning under FSDP2 + TP=2 (8B shape, 16 x 576 tokens, bf16: fp32 masters): stock's rows are within
# TOLERANCE (their peak is generation); turbo's peak is its training phase, forecast from fp32 weights, gradients
# and Adam's states (on the host with `turbo_offload_optimizer_states`) with vLLM's cast copy released. In the
# offloaded row torch's peak (45.11 GiB) counted the 12.19 GiB standby had unmapped: 32.9 GiB were allocated on the
# device, as forecast (32.4 GiB), while the driver counted 44.57 GiB: torch's cached blocks and NCCL's buffers, which
# the forecast does not model, are a third of the device here. The rows without the offload miss by the same kind
# of gap (29 GiB), not broken down.
for stem in ("e2e-llama-3.1-8b-realistic-full-2gpu-tp2-20261127-182353",
             "e2e-llama-3.1-8b-realistic-full-2gpu-tp2-20261128-013723",
             "e2e-llama-3.1-8b-realistic-full-2gpu-tp2-20261128-162103"):
    KNOWN_MISSES[(stem, "turbo")] = 0.40
# With fp8 sampling and half of the states on the host (…-093623): 59.5 GiB against 51.1 forecast. Torch's peak less
# the 7.6 GiB standby had unmapped was 49.3 GiB (the forecast's training phase: 50.7), its cache 6.0 GiB more and
# the driver's count 4.2 GiB beyond that (NCCL's buffers, the CUDA context, vLLM's graph pool).
KNOWN_MISSES[("e2e-llama-3.1-8b-realistic-full-2gpu-tp2-20261129-093623", "turbo-fp8")] = 0.20
# Full fine-tuning on one GPU (8B shape, bf16, 16 x 576 tokens, shared trained parameters, optimizer states on the
# host): the first step peaks at 45.5 GiB, its first micro-batch planned before anything was measured (9.5 layers'
# activations kept, 41.0 GiB predicted); once planned, the steady step peaks at 38.7 GiB against 33.4 GiB forecast
# for the training phase (weights, gradients, activations, the LM head's gradient). The rows with the states on the
# device and under a 60 GiB ceiling are within TOLERANCE (-7.7%, -5.1%), with the same 3-5 GiB of training phase
# beyond the forecast, not broken down. The first of these commands shared nothing (accelerate's unindexed device
# compared unequal to the tensors': fixed since) and held a cast copy of every weight in vLLM.
KNOWN_MISSES[("e2e-llama-3.1-8b-realistic-full-20261129-023723", "turbo")] = 0.35
KNOWN_MISSES[("e2e-llama-3.1-8b-realistic-full-20261129-025327", "turbo")] = 0.30
# The same with fp8 sampling (no parking under full fine-tuning, so held to the forecast, not to an upper bound;
# `trl-turbo plan` under-forecasts these runs, as it does the 16-bit ones above): both rows peak in
# their training phase, over the forecast by 25% (states on the host: 44.6 against 33.4 GiB) and 17.5% (on the
# device: 76.8 against 63.3 GiB). The run's memory plan meant to take that memory: with the states on the host it
# predicted 43.1 GiB for the micro-batch that peaked (46.5 GiB) and kept 1-3 layers' activations and checkpointed 4-8
# on the device, where the bf16 row offloaded all 31. Its ceiling, the last generation's footprint, is 5.9 GiB higher
# with the fp8 copy mapped (27.4 against 21.5 GiB) and the copy leaves with the KV cache, which matches the 5.9 GiB
# the training phase peaked above the bf16 row's; the forecast does not model that spending.
KNOWN_MISSES[("e2e-llama-3.1-8b-realistic-full-20261129-052337", "turbo-fp8")] = 0.30
# Run again with the host pinning that registers one mapping per request (…-075330 alone, …-075713 beside stock):
# 46.8 and 46.5 GiB against the same 33.4 GiB forecast. The run's own memory plan predicted 44.1 and 43.2 GiB for the
# micro-batches it planned (2.75-4 layers' activations kept, 4.6-5.9 GiB spendable under the ceiling), so the run is
# within 6% of its plan; the forecast's training phase (weights, gradients, 3.0 GiB of activations) leaves out the
# same ~10 GiB in both, of which stock's training phase shows ~4 GiB too (65.0 forecast, 69.2 measured).
for stem in ("e2e-llama-3.1-8b-realistic-full-20261129-075330", "e2e-llama-3.1-8b-realistic-full-20261129-075713"):
    KNOWN_MISSES[(stem, "turbo-fp8")] = 0.30
KNOWN_MISSES[("e2e-llama-3.1-8b-realistic-full-20261129-052911", "turbo-fp8")] = 0.22
# A share of the states on the host (0.4, the rest on the device; …-092609): 62.6 GiB against 51.4 forecast. Split by
# the run's new metrics: torch held 53.7 GiB at its peak once the 8.9 GiB standby had unmapped (KV cache and fp8 copy,
# which torch still counts) are taken out (+2.3 over the forecast), its cache 3.3 GiB more (65.8 reserved), and the
# driver counted 5.7 GiB beyond that (CUDA context, vLLM's graph pool, cuBLAS's workspaces), none of which the
# forecast models. The training phase's peak is 12.3 GiB over the generation's: its ceiling (50.3 GiB, the
# generation's footprint) cannot hold the 15 GiB of gradients every training phase needs.
KNOWN_MISSES[("e2e-llama-3.1-8b-realistic-full-20261129-092609", "turbo-fp8")] = 0.25
# Stock's KV pool at TP=4 (Llama-3.3-70B): TRL's 0.3 share less vLLM's weight and KV pools left 1.07 GiB of
# profiling workspace, against the 2.19 GiB `vllm_profile_bytes` fits to 32 and 64 layers at TP 1 and 2: the pool is
# 7.97 GiB against 7.08 GiB forecast. One row at TP=4 does not yet say how the workspace scales with it.
KNOWN_KV_MISSES = {("e2e-llama-3.3-70b-4gpu-tp4-20261128-160918", "stock"): 0.15}


def test_run_peaks_and_kv_cache_match_the_current_e2e_rows(monkeypatch):
    checked = 0
    for result in _results("e2e"):
        config = result["config"]
        _budget_rule_of(result, monkeypatch)
        spec = _spec(config)
        sequences = config["prompts"] * config["generations"]
        for row in result["rows"]:
            if not row["ok"] or row["launch"] != "1gpu" or is_peer(row["variant"]):  # a peer's own engine and plan
                continue
            fields = {**config["common_config"], **config["variant_config"][row["variant"]]}
            args = types.SimpleNamespace(use_vllm=True, per_device_train_batch_size=config["micro_batch"],
                                         steps_per_generation=sequences // config["micro_batch"],
                                         max_completion_length=config["completion_len"], **fields)
            capped = config.get("gpu_gib")  # a capped row stands in for a GPU of that size
            capacity = int(capped * 2**30) if capped else CAPACITY[result["gpu"]]
            forecast = forecast_run(args, spec, capacity_bytes=capacity,
                                    quantized_4bit=config["quantization"] == "nf4",
                                    prompt_tokens=config["prompt_len"], stock=row["variant"] == "stock")
            kv = forecast.phases[0].parts["KV cache"] / 2**30
            # vLLM's sleep-mode pool maps each layer's cache in 2 MiB granules: up to one more per layer
            granules = spec.layers * 2 / 1024
            assert kv == pytest.approx(row["vllm_pool_kv_cache_gib"], rel=0.05, abs=granules), (row["variant"], kv)
            peak = forecast.peak_bytes / 2**30
            measured = row["peak_gib"] - row.get("others_gib", 0.0)  # the child's own (capped rows record the rest)
            # LoRA's fp8 rows: an upper bound, the parked base weights are not counted on (full fine-tuning parks none)
            if row["variant"] == "turbo-fp8" and config["lora"]:
                assert peak >= measured, (peak, measured)
            elif (result["stem"], row["variant"]) in KNOWN_MISSES:
                bound = KNOWN_MISSES[result["stem"], row["variant"]]
                assert TOLERANCE < abs(peak / measured - 1) <= bound, (result["stem"], peak, measured, bound)
            else:
                assert peak == pytest.approx(measured, rel=TOLERANCE), (row["variant"], peak, measured)
            checked += 1
    assert checked >= 6, checked


# FSDP2 + tensor-parallel rows measured with the per-rank KV budget (its KV heads, from commit f5aaf79 on)
FSDP2_TP_CURRENT_FROM = "2026-11-27T18:20"


def test_per_gpu_forecast_matches_the_current_fsdp2_tensor_parallel_rows(monkeypatch):
    """`trl-turbo plan --processes N --tp T`: per GPU, FSDP2's shards (turbo: one copy, each rank's vLLM slices;
    stock: an FSDP2 shard and a vLLM shard of every weight), the rank's KV heads for its TP group's sequences."""
    checked = 0
    for result in _results("e2e"):
        config = result["config"]
        if result["date"] < FSDP2_TP_CURRENT_FROM or "fsdp2" not in config["processes_per_launch"]:
            continue
        _budget_rule_of(result, monkeypatch)
        spec = _spec(config)
        sequences = config["prompts"] * config["generations"]
        for row in result["rows"]:
            # rows record their own tensor-parallel size and GPU count (a command may run several); older files
            # keep them in the config
            tp = row.get("vllm_tp", config.get("vllm_tp", 1))
            if not row["ok"] or row["launch"] != "fsdp2" or tp < 2:
                continue
            processes = row["processes"]
            monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
            fields = {**config["common_config"], **config["variant_config"][row["variant"]]}
            args = types.SimpleNamespace(use_vllm=True, per_device_train_batch_size=config["micro_batch"],
                                         steps_per_generation=sequences // config["micro_batch"],
                                         max_completion_length=config["completion_len"], world_size=processes,
                                         fsdp="full_shard", fsdp_config={"version": 2},
                                         vllm_tensor_parallel_size=tp, **fields)
            capped = config.get("gpu_gib")  # each rank capped, standing in for a smaller GPU
            capacity = int(capped * 2**30) if capped else CAPACITY[result["gpu"]]
            forecast = forecast_run(args, spec, capacity_bytes=capacity, prompt_tokens=config["prompt_len"],
                                    stock=row["variant"] == "stock")
            kv = forecast.phases[0].parts["KV cache"] / 2**30
            if (result["stem"], row["variant"]) in KNOWN_KV_MISSES:
                kv_miss = abs(kv / row["vllm_pool_kv_cache_gib"] - 1)
                assert 0.05 < kv_miss <= KNOWN_KV_MISSES[result["stem"], row["variant"]], (result["stem"], kv)
            else:
                assert kv == pytest.approx(row["vllm_pool_kv_cache_gib"], rel=0.05, abs=spec.layers * 2 / 1024)
            # a row measured before the bench counted accelerate's preparation records it beside its peak
            measured = max([row["peak_gib"], *row.get("preparation_peak_gib_per_rank", [])])
            miss = abs(forecast.peak_bytes / 2**30 / (measured - row.get("others_gib", 0.0)) - 1)
            if (result["stem"], row["variant"]) in KNOWN_MISSES:
                assert TOLERANCE < miss <= KNOWN_MISSES[result["stem"], row["variant"]], (result["stem"], miss)
            else:
                assert miss <= TOLERANCE, (result["stem"], row["variant"], miss)
            if row["variant"] != "stock":
                assert forecast.plan.engine.sharded and forecast.plan.engine.tp_size == tp
                slice_bytes = spec.weight_bytes(False) // tp
                if config["lora"] is not None:
                    assert forecast.phases[-1].parts["weights"] == slice_bytes
                else:  # fp32 masters and their gradients; vLLM's own 16-bit slice, released while training
                    training = forecast.phases[-1].parts
                    assert training["weights"] == training["gradients"] == 2 * slice_bytes
                    # vLLM's own 16-bit slice; with fp8 sampling its linear weights are e4m3 (written from them)
                    fp8_saving = spec.layer_linear_parameters // tp if row["variant"] == "turbo-fp8" else 0
                    assert forecast.cast_copy
                    assert forecast.phases[0].parts["vLLM weights"] == slice_bytes - fp8_saving
                    assert training["vLLM resident"] == 0
            checked += 1
    assert checked >= 2, checked


def test_cli_forecasts_per_gpu_under_fsdp2_and_refuses_a_tp_size_that_does_not_fit(capsys):
    assert cli_main(["plan", "--config", str(EXAMPLE), "--model", "llama-3.1-8b", "--gpu-gib", "80", "--host-gib",
                     "64", "--processes", "2", "--tp", "2"]) in (0, 1)
    assert "per GPU: FSDP2 over 2 processes, vLLM tensor-parallel size 2" in capsys.readouterr().out
    assert cli_main(["plan", "--config", str(EXAMPLE), "--model", "llama-3.1-8b", "--gpu-gib", "80", "--processes",
                     "2", "--tp", "4"]) == 2
    assert "must divide the 2 processes per node" in capsys.readouterr().err


def test_auto_picks_another_plan_on_a_smaller_gpu():
    spec = model_spec(load_config("llama-3.1-8b"), 16)
    batch = MicroBatch(8, 256 + 2048)
    big, small = (forecast_training(spec, batch, mode="auto", capacity_bytes=capacity,
                                    static_bytes=spec.weight_bytes(False) + 4 * spec.lora_parameters)
                  for capacity in CAPACITY.values())
    assert (big.groups, big.plan.kept_layers) == (1, 32)  # the H200 keeps every layer in one forward
    assert small.groups > 1 or small.plan.kept_layers < 32
    assert small.peak_bytes < CAPACITY["NVIDIA H100 80GB HBM3"] < big.peak_bytes


def test_a_training_memory_budget_above_the_generation_peak_keeps_more_activations():
    """Realistic preset, H200, shared weights + standby: by default training stays under the generation phase's
    peak, in small sequence groups; a larger `turbo_training_memory_gib` buys larger groups, up to it."""
    spec = model_spec(load_config("llama-3.1-8b"), 16)
    fields = dict(use_vllm=True, vllm_mode="colocate", per_device_train_batch_size=16, steps_per_generation=4,
                  max_completion_length=2048, vllm_max_model_length=2112, turbo_vllm_shared_weights=True,
                  turbo_vllm_standby=True)
    capacity = CAPACITY["NVIDIA H200"]
    default = forecast_run(types.SimpleNamespace(**fields), spec, capacity_bytes=capacity, prompt_tokens=64)
    budgeted = forecast_run(types.SimpleNamespace(**fields, turbo_training_memory_gib=48.0), spec,
                            capacity_bytes=capacity, prompt_tokens=64)
    generation = next(p for p in default.phases if p.name == "generation").device_bytes
    assert default.training.peak_bytes <= generation and default.training.groups > 1
    assert budgeted.training.group_sequences > default.training.group_sequences
    assert generation < budgeted.training.peak_bytes <= 48 * 2**30


def test_full_finetuning_on_one_gpu_trains_vllms_weights_and_its_16_bit_optimizer_states():
    """No adapter, one GPU: the 16-bit parameters train and are vLLM's weights (no copy), their gradients and Adam's
    two moments in 16 bits; offloaded, the moments move to the host."""
    spec = model_spec(load_config("llama-3.1-8b"), None)
    fields = dict(use_vllm=True, vllm_mode="colocate", per_device_train_batch_size=8, steps_per_generation=1,
                  max_completion_length=512, vllm_max_model_length=576, turbo_vllm_shared_weights=True,
                  turbo_vllm_standby=True, bf16=True)
    capacity = CAPACITY["NVIDIA H200"]
    forecast = forecast_run(types.SimpleNamespace(**fields), spec, capacity_bytes=capacity, prompt_tokens=64)
    training = forecast.phases[-1].parts
    assert not forecast.cast_copy and forecast.phases[0].parts["vLLM weights"] == 0
    assert training["weights"] == training["gradients"] == 2 * spec.parameters
    assert training["optimizer"] == 4 * spec.parameters
    offloaded = forecast_run(types.SimpleNamespace(**fields, turbo_offload_optimizer_states=True), spec,
                             capacity_bytes=capacity, prompt_tokens=64)
    assert offloaded.phases[-1].parts["optimizer"] == 0
    assert offloaded.phases[-1].host_bytes >= 4 * spec.parameters
    assert offloaded.peak_bytes < forecast.peak_bytes
    # a share moves that share of the states: the rest stay in the training phase and shrink the KV budget alike
    quarter = forecast_run(types.SimpleNamespace(**fields, turbo_offload_optimizer_states=0.25), spec,
                           capacity_bytes=capacity, prompt_tokens=64)
    assert quarter.phases[-1].parts["optimizer"] == 3 * spec.parameters
    assert quarter.phases[-1].host_bytes - offloaded.phases[-1].host_bytes == -3 * spec.parameters
    # the KV budget reserves the states that stay on the device (the cache here is capped by what 8 sequences fill)
    kv = [auto_kv_cache_bytes(free_bytes=64 * 2**30, total_bytes=capacity, vllm_weight_bytes=0,
                              trainable_params=2**30, sampling_workspace_bytes=0, useful_bytes=2**40,
                              states_on_host=share) for share in (0.0, 0.25, 1.0)]
    assert kv[1] - kv[0] == 0.25 * 8 * 2**30 and kv[2] - kv[0] == 8 * 2**30
    assert offloaded.peak_bytes < quarter.peak_bytes <= forecast.peak_bytes


def test_cli_prints_the_phases_of_the_shipped_config(capsys):
    assert cli_main(["plan", "--config", str(EXAMPLE), "--model", "llama-3.1-8b", "--gpu-gib", "80",
                     "--host-gib", "64"]) == 0
    out = capsys.readouterr().out
    for phase in ("start-up", "generation", "training", "peak"):
        assert phase in out
    assert "fits                       yes" in out and "longest completion that fits" in out
    assert cli_main(["plan", "--config", str(EXAMPLE), "--model", "llama-3.1-8b", "--gpu-gib", "20",
                     "--host-gib", "64"]) == 1
    assert "NO (+" in capsys.readouterr().out


def test_cli_refuses_bad_input_with_the_reason(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLE.read_text() + "turbo_memry_plan: min\n")
    assert cli_main(["plan", "--config", str(bad), "--model", "llama-3.1-8b", "--gpu-gib", "80"]) == 2
    assert "turbo_memry_plan" in capsys.readouterr().err
    bad.write_text(EXAMPLE.read_text() + "turbo_memory_plan: fastest\n")
    assert cli_main(["plan", "--config", str(bad), "--model", "llama-3.1-8b", "--gpu-gib", "80"]) == 2
    assert "turbo_memory_plan='fastest'" in capsys.readouterr().err


def test_longer_completions_fit_on_larger_devices_and_with_trl_turbo():
    values = {"per_device_train_batch_size": 8, "max_completion_length": 1024, "use_peft": True, "lora_r": 16}
    small = plan(values, "llama-3.1-8b", gpu_gib=40, host_gib=64)
    large = plan(values, "llama-3.1-8b", gpu_gib=80, host_gib=64)
    assert small.stock_longest < large.stock_longest
    assert small.stock_longest < small.turbo_longest <= large.turbo_longest
    assert small.turbo_min_peak <= small.turbo.peak_bytes


def test_a_70b_qlora_grpo_step_needs_50_gib_with_vllms_fp32_block_scales_and_stock_cannot_start_there():
    # The largest capped run: Llama-3.3-70B shape, NF4, colocated vLLM sharing the 4-bit weights, 1 prompt x 8 x 1024.
    # vLLM undoes double quantization (fp32 block scales, 4 GiB here), so 48 GiB leaves its KV cache no room, as the
    # GPU run refused at start-up (e2e-llama-3.3-70b-nf4-cap48gib-20261126-153600, 0.8 GiB short both ways).
    values = {"per_device_train_batch_size": 8, "num_generations": 8, "max_completion_length": 1024, "use_peft": True,
              "lora_r": 16, "load_in_4bit": True, "use_vllm": True, "vllm_mode": "colocate",
              "vllm_max_model_length": 1088, "turbo_vllm_shared_weights": True, "turbo_vllm_standby": True,
              "gradient_checkpointing": True, "bf16": True, "use_bnb_nested_quant": True}  # as the bench's NF4
    at_48 = plan(values, "llama-3.3-70b", gpu_gib=48, host_gib=128)
    assert at_48.quantized_4bit and at_48.spec.layers == 80
    assert "KV cache" in at_48.turbo.error
    vllm_scales = at_48.turbo.phases[0].parts["vLLM weights"] / 2**30
    assert 3.9 < vllm_scales < 4.1, vllm_scales  # 4 bytes per 64 of the 68.5 billion linear weights
    at_50 = plan(values, "llama-3.3-70b", gpu_gib=50, host_gib=128)
    assert at_50.turbo.error is None
    assert at_50.turbo.peak_bytes <= 50 * 2**30 < at_50.stock.peak_bytes
    # Single-quantized (TRL's default): the training model's scales are fp32 already and vLLM shares them as they are
    single = plan({**values, "use_bnb_nested_quant": False}, "llama-3.3-70b", gpu_gib=50, host_gib=128)
    assert single.turbo.phases[0].parts["vLLM weights"] == 0
    assert single.turbo.phases[0].parts["weights"] - at_50.turbo.phases[0].parts["weights"] > 2.9 * 2**30


def test_hsdp_shards_the_training_state_over_the_tensor_parallel_group_only(monkeypatch):
    """With shared weights on 4 GPUs and T=2, FSDP2's shard group is vLLM's tensor-parallel group (HSDP): each GPU
    holds half of the weights and of the adapter's training state, replicated across the two groups; without shared
    weights the shard group is all four."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    spec = model_spec(load_config("llama-3.1-8b"), 16)
    common = dict(use_vllm=True, vllm_mode="colocate", per_device_train_batch_size=8, steps_per_generation=1,
                  max_completion_length=1024, world_size=4, fsdp="full_shard", fsdp_config={"version": 2},
                  vllm_tensor_parallel_size=2, gradient_checkpointing=True)
    shared = forecast_run(types.SimpleNamespace(**common, turbo_vllm_shared_weights=True, turbo_vllm_standby=True),
                          spec, capacity_bytes=80 * 2**30, prompt_tokens=256)
    parts = shared.phases[-1].parts
    assert parts["weights"] == spec.weight_bytes(False) // 2
    assert parts["adapter"] == 4 * spec.lora_parameters // 2
    # two layers whole (computing, prefetched) and the root whole beside its shard: the embedding, an untied LM
    # head and the final norm
    root = 2 * spec.root_parameters
    assert spec.root_parameters == 2 * spec.vocab_size * spec.hidden_size + spec.hidden_size
    assert parts["gathered weights"] == 2 * ((spec.weight_bytes(False) - root) // spec.layers) + root
    whole = forecast_run(types.SimpleNamespace(**{**common, "vllm_tensor_parallel_size": 1},
                                               turbo_vllm_shared_weights=True, turbo_vllm_standby=True),
                         spec, capacity_bytes=80 * 2**30, prompt_tokens=256)
    # T=1: shard groups of one, whole weights on every GPU, nothing gathered
    assert whole.phases[-1].parts["weights"] == spec.weight_bytes(False)
    assert "gathered weights" not in whole.phases[-1].parts
    stock = forecast_run(types.SimpleNamespace(**common, vllm_enable_sleep_mode=True), spec,
                         capacity_bytes=80 * 2**30, prompt_tokens=256, stock=True)
    assert stock.phases[-1].parts["weights"] == spec.weight_bytes(False) // 4
    assert stock.phases[-1].parts["adapter"] == 4 * spec.lora_parameters // 4


def test_where_trl_turbos_checkpointing_is_off_the_forecast_trains_as_the_run_does(monkeypatch):
    """Under FSDP2 with transformers before 5.23 the run keeps transformers' checkpointing (no layer plan), one
    sequence group at a time: so does the forecast, and the report says so instead of printing a layer plan the run
    would not make. From 5.23 both plan the layers."""
    monkeypatch.setattr("trl_turbo.versions.installed_version", lambda package: "5.22.0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    spec = model_spec(load_config("llama-3.1-8b"), 16)
    args = types.SimpleNamespace(use_vllm=True, vllm_mode="colocate", per_device_train_batch_size=16,
                                 steps_per_generation=4, max_completion_length=2048, world_size=2, fsdp="full_shard",
                                 fsdp_config={"version": 2}, vllm_tensor_parallel_size=2, gradient_checkpointing=True,
                                 turbo_vllm_shared_weights=True, turbo_vllm_standby=True)
    forecast = forecast_run(args, spec, capacity_bytes=80 * 2**30, prompt_tokens=64)
    assert not forecast.plan.memory.checkpointing and forecast.plan.memory.mode == "auto"
    training = forecast.training
    assert training.mode == "off" and training.plan is None
    assert (training.groups, training.group_sequences) == (2, 8)  # 16 x 2112 tokens over a 32768-token budget
    single = forecast_run(types.SimpleNamespace(**{**vars(args), "world_size": 1, "fsdp": None, "fsdp_config": None,
                                                   "vllm_tensor_parallel_size": 1}),
                          spec, capacity_bytes=80 * 2**30, prompt_tokens=64)
    assert single.plan.memory.checkpointing and single.training.plan is not None  # one GPU: the layer plan
    monkeypatch.setattr("trl_turbo.versions.installed_version", lambda package: "5.23.0")
    layered = forecast_run(args, spec, capacity_bytes=80 * 2**30, prompt_tokens=64)
    assert layered.plan.memory.checkpointing and layered.training.plan is not None


def test_cli_forecasts_full_finetuning_under_fsdp2_with_vllms_cast_copy(tmp_path, capsys):
    config = tmp_path / "full.yaml"
    config.write_text("model_name_or_path: llama-3.1-8b\nbf16: true\nper_device_train_batch_size: 16\n"
                      "num_generations: 8\nmax_completion_length: 512\nuse_vllm: true\nvllm_mode: colocate\n"
                      "turbo_vllm_shared_weights: true\nturbo_vllm_standby: true\n"
                      "turbo_offload_optimizer_states: true\n")
    assert cli_main(["plan", "--config", str(config), "--gpu-gib", "139.8", "--host-gib", "200", "--processes", "2",
                     "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "full fine-tuning" in out and "cast into from each rank's fp32 shards" in out
    assert "100% of the optimizer's states on the host" in out
    config.write_text(config.read_text().replace("turbo_offload_optimizer_states: true",
                                                 "turbo_offload_optimizer_states: 0.35"))
    assert cli_main(["plan", "--config", str(config), "--gpu-gib", "139.8", "--host-gib", "200"]) == 0
    assert "35% of the optimizer's states on the host" in capsys.readouterr().out


def test_full_finetuning_without_shared_weights_keeps_vllms_copy_and_4_bit_full_finetuning_is_refused(monkeypatch):
    """Standby alone releases only the KV cache: vLLM's own weights stay through training. The trainer refuses to
    train a purely 4-bit model, and so does the forecast."""
    from trl_turbo.planning.run import run_plan_of

    spec = model_spec(load_config("llama-3.1-8b"), None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    fields = dict(use_vllm=True, vllm_mode="colocate", per_device_train_batch_size=8, steps_per_generation=1,
                  max_completion_length=512, vllm_max_model_length=576, turbo_vllm_standby=True, bf16=True,
                  world_size=2, fsdp="full_shard", fsdp_config={"version": 2}, vllm_tensor_parallel_size=2)
    forecast = forecast_run(types.SimpleNamespace(**fields), spec, capacity_bytes=CAPACITY["NVIDIA H200"],
                            prompt_tokens=64)
    assert not forecast.cast_copy
    assert forecast.phases[-1].parts["vLLM resident"] == spec.weight_bytes(False) // 2
    with pytest.raises(ValueError, match="purely quantized"):
        run_plan_of(types.SimpleNamespace(**fields), spec, quantized_4bit=True)


def test_the_report_calls_min_the_least_only_where_it_is(monkeypatch):
    """'min' runs forwards as large as the token budget allows, so where 'auto' splits a large micro-batch into
    smaller groups (Llama-3.3-70B, 8 x 2112 tokens per rank under FSDP2 + TP=4) "min" needs more, and the report
    says so instead of calling it the least."""
    from trl_turbo.planning.report import render

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    values = dict(use_vllm=True, vllm_mode="colocate", per_device_train_batch_size=8, num_generations=8,
                  max_completion_length=2048, vllm_tensor_parallel_size=4, turbo_vllm_shared_weights=True,
                  turbo_vllm_standby=True, gradient_checkpointing=True, beta=0.0, use_peft=True, lora_r=16,
                  lora_alpha=16, lora_target_modules="all-linear", fsdp="full_shard", fsdp_config={"version": 2})
    forecast = plan(values, "llama-3.3-70b", gpu_gib=79.1, host_gib=512, prompt_tokens=64, processes=4)
    assert forecast.turbo_min_peak > forecast.turbo.peak_bytes and forecast.turbo.training.groups > 1
    text = render(forecast)
    assert "the least trl_turbo needs" not in text and "turbo_memory_plan='min' would need" in text
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    one_gpu = {**values, "vllm_tensor_parallel_size": 1, "fsdp": "", "fsdp_config": None}
    small = plan(one_gpu, "llama-3.1-8b", gpu_gib=40, host_gib=64, prompt_tokens=64)
    assert small.turbo_min_peak <= small.turbo.peak_bytes and "the least trl_turbo needs" in render(small)
