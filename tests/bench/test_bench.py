"""CPU tests of the benchmark harness (`python -m trl_turbo.bench`): tiny shapes, schema of the written results.

The numbers measured on CPU mean nothing; what is checked is that every code path of the GPU run (both variants,
TIS, OOM handling, every loss implementation, JSON/PNG/table writing) executes and writes what the README promises.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch

from trl_turbo.bench import __main__ as cli
from trl_turbo.bench import e2e, gpu_children, loss, parse_turbo_overrides, results, train
from trl_turbo.planning.shapes import LOSS_PRESETS, SHAPES, build_config

TOP_KEYS = {"benchmark", "commit", "dirty", "date", "gpu", "versions", "command", "config", "rows"}
VERSION_KEYS = {"torch", "transformers", "trl", "peft", "accelerate", "triton", "trl_turbo", "cuda"}
TRAIN_ROW_KEYS = {"variant", "shape", "micro_batch", "prompt_len", "completion_len", "ok", "peak_gib", "static_gib",
                  "step_s", "tokens_per_s", "tis"}
LOSS_ROW_KEYS = {"impl", "hidden", "vocab", "micro_batch", "completion_len", "tokens", "ok", "peak_extra_gib",
                 "peak_extra_beyond_grad_gib", "fwd_bwd_ms"}


def _turbo_available() -> bool:
    import trl_turbo

    return hasattr(trl_turbo, "patch") and hasattr(trl_turbo, "unpatch")


def _fused_logprobs_available() -> bool:
    try:
        from trl_turbo.ops import fused_logprobs  # noqa: F401
    except ImportError:
        return False
    return True


needs_turbo = pytest.mark.skipif(not _turbo_available(), reason="trl_turbo.patch/unpatch not written yet")


@pytest.fixture(autouse=True)
def _restore_patch_state():
    yield
    if _turbo_available():
        import trl_turbo

        trl_turbo.patch()


def _load_single(out: Path, benchmark: str) -> dict:
    files = sorted(out.glob(f"{benchmark}-*.json"))
    assert len(files) == 1, files
    assert files[0].with_suffix(".png").stat().st_size > 0
    data = json.loads(files[0].read_text())
    assert TOP_KEYS <= data.keys()
    assert VERSION_KEYS <= data["versions"].keys()
    assert data["benchmark"] == benchmark and data["gpu"] == "cpu"
    assert isinstance(data["dirty"], bool) and data["commit"]
    return data


def test_shapes_build_real_configs():
    llama = build_config("llama-3.1-8b")
    assert (llama.hidden_size, llama.intermediate_size, llama.num_hidden_layers) == (4096, 14336, 32)
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.vocab_size) == (32, 8, 128256)
    assert llama.max_position_embeddings >= 131072
    qwen = build_config("qwen2.5-1.5b")
    assert (qwen.hidden_size, qwen.intermediate_size, qwen.num_hidden_layers) == (1536, 8960, 28)
    assert (qwen.num_attention_heads, qwen.num_key_value_heads, qwen.vocab_size) == (12, 2, 151936)
    assert qwen.tie_word_embeddings
    assert build_config("qwen3-8b").model_type == "qwen3"
    assert {"tiny", "llama-3.1-8b", "qwen2.5-1.5b", "qwen3-8b"} <= SHAPES.keys()
    assert LOSS_PRESETS["issue3"] == [(4096, 128256), (1536, 151936)]
    with pytest.raises(KeyError, match="known shapes"):
        build_config("nope")


@needs_turbo
@pytest.mark.parametrize("tis", [False, True])
def test_train_both_variants(tmp_path, tis):
    lengths = [8, 16] if not tis else [8]  # unsorted on the command line: the benchmark runs them ascending
    argv = ["train", "--shape", "tiny", "--micro-batch", "2", "--lengths", ",".join(map(str, reversed(lengths))),
            "--prompt-len", "4", "--out", str(tmp_path), "--device", "cpu"]
    cli.main(argv + (["--tis"] if tis else []))
    data = _load_single(tmp_path, "train")
    assert data["config"]["shape"] == "tiny" and data["config"]["tis"] is tis
    assert "trl_turbo.bench" in data["command"] or "pytest" in data["command"]
    rows = data["rows"]
    assert [(r["variant"], r["completion_len"]) for r in rows] == [(v, n) for v in ("stock", "turbo") for n in lengths]
    for row in rows:
        assert TRAIN_ROW_KEYS <= row.keys()
        assert row["ok"], row["error"]
        assert row["tis"] is tis and row["step_s"] > 0 and row["tokens_per_s"] > 0
        assert row["peak_gib"] is None  # no allocator statistics on CPU
    assert all(r["old_logps_pass"] is tis for r in rows if r["variant"] == "stock")
    table = results.render_table(tmp_path)
    assert "### train: tiny on cpu" in table and "turbo/stock step s" in table and "×" in table


@needs_turbo
def test_train_forward_token_budget_splits_turbo_micro_batches(tmp_path, monkeypatch):
    from trl_turbo.grpo import loss_step

    groups_seen = []
    real = loss_step.grouped_compute_loss

    def recording(self, model, inputs, groups):
        groups_seen.append([(g.start, g.stop) for g in groups])
        return real(self, model, inputs, groups)

    monkeypatch.setattr(loss_step, "grouped_compute_loss", recording)
    cli.main(["train", "--shape", "tiny", "--micro-batch", "4", "--lengths", "8", "--prompt-len", "4",
              "--forward-token-budget", "24", "--steps", "1", "--warmup", "0", "--out", str(tmp_path),
              "--device", "cpu"])
    data = _load_single(tmp_path, "train")
    assert data["config"]["forward_token_budget"] == 24
    assert all(row["ok"] for row in data["rows"]), data["rows"]
    assert groups_seen == [[(0, 2), (2, 4)]]  # turbo only: 4 sequences of 12 tokens in groups of 2; stock unsplit
    with pytest.raises(SystemExit):
        cli.main(["train", "--shape", "tiny", "--forward-token-budget", "0", "--out", str(tmp_path)])


def test_train_turbo_set_reaches_the_turbo_trainers_only(monkeypatch):
    seen = {}

    def recording(model, micro_batch, completion_len, device, output_dir, tis, fields):
        seen[fields.get("turbo_memory_plan", "stock" if not fields else "auto")] = fields
        raise RuntimeError("stop after the config")  # recorded by run_length as the row's error

    monkeypatch.setattr(train, "build_trainer", recording)
    args = type("Args", (), {"micro_batch": 2, "prompt_len": 4, "tis": False, "forward_token_budget": None,
                             "turbo_set": ["turbo_memory_plan=min", "turbo_training_memory_gib=25"],
                             "shape": "tiny", "quantization": "none", "steps": 1, "warmup": 0})()
    for variant in ("stock", "turbo"):
        row = train.run_length(torch.nn.Linear(1, 1), variant, 8, args, torch.device("cpu"), "unused")
        assert not row["ok"] and "stop after the config" in row["error"]
    assert seen["stock"] == train.VARIANT_CONFIG["stock"]
    assert seen["min"] == {**train.VARIANT_CONFIG["turbo"], "turbo_memory_plan": "min",
                           "turbo_training_memory_gib": 25}
    with pytest.raises(SystemExit, match="sets this itself"):
        cli.main(["train", "--shape", "tiny", "--variants", "turbo-min", "--turbo-set", "turbo_memory_plan=auto",
                  "--device", "cpu"])


@needs_turbo
def test_train_oom_skips_longer_lengths(tmp_path, monkeypatch):
    real_measure = train.measure

    def measure_or_oom(trainer, inputs, with_old_pass, device, steps, warmup):
        if inputs["completion_ids"].size(1) > 8:
            raise torch.OutOfMemoryError("simulated")
        return real_measure(trainer, inputs, with_old_pass, device, steps, warmup)

    monkeypatch.setattr(train, "measure", measure_or_oom)
    cli.main(["train", "--shape", "tiny", "--micro-batch", "2", "--lengths", "8,16,32", "--prompt-len", "4",
              "--variants", "stock", "--out", str(tmp_path), "--device", "cpu"])
    rows = _load_single(tmp_path, "train")["rows"]
    assert [(r["completion_len"], r["ok"], r["error"]) for r in rows] == [(8, True, None), (16, False, "OOM")]
    assert "OOM" in results.render_table(tmp_path)


def test_train_importance_sampling_ratio_matches_trl_modes():
    class Modes:
        vllm_importance_sampling_clip_min = None
        vllm_importance_sampling_clip_max = 3.0

    old = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
    sampling = torch.tensor([[-1.5, -2.0], [-0.2, -0.3]])
    mask = torch.ones(2, 2)
    trainer = Modes()
    trainer.vllm_importance_sampling_mode = "sequence_mask"
    ratio = train.importance_sampling_ratio(trainer, old, sampling, mask)
    assert ratio.shape == (2, 1)
    torch.testing.assert_close(ratio[0, 0], torch.exp(torch.tensor(0.5)))
    assert ratio[1, 0] == pytest.approx(torch.exp(torch.tensor(-1.5)).item())
    trainer.vllm_importance_sampling_mode = "token_truncate"
    ratio = train.importance_sampling_ratio(trainer, torch.tensor([[0.0, 5.0]]), torch.zeros(1, 2), torch.ones(1, 2))
    torch.testing.assert_close(ratio, torch.tensor([[1.0, 3.0]]))


def _available_impls() -> list[str]:
    return ["trl", "liger"] + (["turbo"] if _fused_logprobs_available() else [])


def test_loss_benchmark_cpu(tmp_path):
    impls = _available_impls()
    cli.main(["loss", "--preset", "tiny", "--micro-batch", "2", "--lengths", "8,16", "--impls", ",".join(impls),
              "--repeats", "2", "--dtype", "fp32", "--out", str(tmp_path), "--device", "cpu"])
    data = _load_single(tmp_path, "loss")
    rows = data["rows"]
    assert len(rows) == len(LOSS_PRESETS["tiny"]) * 2 * len(impls)
    for row in rows:
        assert LOSS_ROW_KEYS <= row.keys()
        assert row["ok"], row["error"]
        assert row["tokens"] == row["micro_batch"] * row["completion_len"] and row["fwd_bwd_ms"] > 0
    table = results.render_table(tmp_path)
    assert "### loss: tiny on cpu" in table and "| hidden |" in table


def test_loss_implementations_agree():
    """All implementations give the same DAPO loss and hidden-state gradient: the benchmark compares like with like."""
    inputs = loss.make_inputs(32, 300, 2, 12, torch.float32, torch.device("cpu"))
    values = {}
    for impl in _available_impls():
        inputs["hidden"].grad = None
        value = loss.LOSS_FNS[impl](inputs["hidden"], inputs["weight"], inputs["targets"], inputs["advantages"], 2)
        value.backward()
        values[impl] = (value.detach(), inputs["hidden"].grad.clone())
    reference = values.pop("trl")
    for impl, (value, grad) in values.items():
        torch.testing.assert_close(value, reference[0], rtol=1e-4, atol=1e-6, msg=impl)
        torch.testing.assert_close(grad, reference[1], rtol=1e-4, atol=1e-6, msg=impl)


def test_table_without_results(tmp_path):
    assert results.render_table(tmp_path) == "_no results_\n"


# ------------------------------------------------------------------------------------------------------- e2e
def test_e2e_checkpoint_prompts_and_rewards(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    path = tmp_path / "ckpt"
    identity = e2e.prepare_checkpoint("tiny", path, seed=0, device="cpu")
    assert identity["shape"] == "tiny"
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert e2e.prepare_checkpoint("tiny", path, seed=0, device="cpu") == identity
    assert weights.stat().st_mtime_ns == stamp  # reused, not rewritten
    config = AutoConfig.from_pretrained(path)
    assert (config.vocab_size, config.eos_token_id) == (SHAPES["tiny"]["vocab_size"], 1)
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = e2e.prompts(3, 16, config.vocab_size, seed=0)
    assert texts == e2e.prompts(3, 16, config.vocab_size, seed=0) and len(set(texts)) == 3
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert len(ids) == 16 and min(ids) >= 4
    # every id a random model can sample decodes to a token of its own
    assert tokenizer.decode(list(range(4, config.vocab_size))).split() == [f"t{i}" for i in range(4, config.vocab_size)]
    assert tokenizer.eos_token_id == config.eos_token_id
    rewards = e2e.hashed_reward(texts)
    assert rewards == e2e.hashed_reward(texts) and len(set(rewards)) == 3
    assert all(0 <= r < 1 for r in rewards)


def _e2e_row(variant: str, step_s: float, peak: float) -> dict:
    steps = [{"step_s": step_s * (1.5 if i == 0 else 1), "generate_s": step_s / 2, "sync_s": 0.1,
              "generation_peak_gib": peak, "train_peak_gib": peak / 2, "peak_gib": peak} for i in range(3)]
    return {"variant": variant, "ok": True, "generations": 8, "prompt_len": 64, "completion_len": 4096,
            "distinct_weights_gib": 15.0, "timeline": [(0.0, 1.0), (1.0, peak)], "steps": steps,
            **e2e.summarize(steps, warmup=1)}


def test_e2e_results_summary_plot_and_table(tmp_path):
    rows = [_e2e_row("stock", 30.0, 58.0), _e2e_row("turbo", 20.0, 29.0)]
    assert rows[0]["step_s"] == 30.0  # the warm-up step (45 s) is left out of the median
    assert rows[0]["peak_gib"] == 58.0 and rows[1]["sync_s"] == 0.1
    meta = results.metadata("e2e", torch.device("cpu"), {"shape": "llama-3.1-8b"})
    path = e2e.write_results(meta, rows, tmp_path, "e2e-llama-3.1-8b-test")
    assert path.with_suffix(".png").stat().st_size > 0
    assert "turbo" in e2e.format_row(rows[1]) and "FAILED" in e2e.format_row({"variant": "turbo", "ok": False})
    table = results.render_table(tmp_path)
    assert "### e2e: llama-3.1-8b" in table
    assert "| 8 | 64 | 4096 | 58.00 | 29.00 | 0.50× | 30.00 | 20.00 | 0.67× |" in table


@pytest.mark.parametrize("shape", ["qwen2.5-1.5b", "llama-3.1-8b", "gemma2-9b"])
def test_e2e_tokenizer_encodes_prompts_whatever_the_model_type(shape, tmp_path):
    from trl_turbo.planning.shapes import build_config

    config = build_config(shape)
    config.save_pretrained(tmp_path)  # its model_type is what transformers would pick a tokenizer class from
    e2e.wordlevel_tokenizer(config.vocab_size).save_pretrained(tmp_path)
    tokenizer = e2e.load_tokenizer(tmp_path)
    text = e2e.prompts(1, 8, tokenizer.vocab_size, seed=0)[0]
    assert len(tokenizer(text).input_ids) == 8


def test_e2e_presets_and_overrides():
    import argparse

    def workload(*argv):
        parser = argparse.ArgumentParser()
        e2e.add_parser(parser.add_subparsers())
        return e2e.resolve_workload(parser.parse_args(["e2e", "--shape", "tiny", *argv]))

    assert workload() == {"prompts": 1, "generations": 8, "completion_len": 4096, "micro_batch": 8}
    assert workload("--preset", "realistic") == {"prompts": 8, "generations": 8, "completion_len": 2048,
                                                 "micro_batch": 16}
    assert workload("--preset", "realistic", "--completion-len", "512")["completion_len"] == 512
    with pytest.raises(SystemExit, match="must divide"):
        workload("--preset", "realistic", "--micro-batch", "24")


def test_e2e_gpu_cap_counts_the_drivers_context_on_gpu0_only_and_shows_in_rows_and_plot(tmp_path):
    spec = {"device_used_before": 5 * 2**29}
    assert e2e.others_before(spec, torch.device("cuda", 0)) == 5 * 2**29
    assert e2e.others_before(spec, torch.device("cuda", 3)) == 0  # a launched rank's own GPU
    capped = {**_e2e_row("turbo", 20.0, 4.6), "cap_gib": 5.0, "others_gib": 0.5}
    assert "(capped at 5 GiB) own peak=  4.10 GiB " in e2e.format_row(capped)
    assert "capped at 5 GiB" in e2e.format_row({"variant": "stock", "ok": False, "error": "OOM", "cap_gib": 5.0})
    meta = results.metadata("e2e", torch.device("cpu"), {"shape": "qwen2.5-1.5b"})
    assert e2e.write_results(meta, [capped], tmp_path, "e2e-cap").with_suffix(".png").exists()


def test_e2e_cap_gives_a_share_sized_engine_its_share_of_the_capped_device_and_leaves_turbos_budget_alone():
    h200, h100 = 140 * 2**30, 80 * 2**30
    assert e2e.capped_engine_share(True, 0.3, h100, h200) == pytest.approx(0.3 * 80 / 140)  # 24 GiB, as on an H100
    assert e2e.capped_engine_share(True, 0.3, h200, h200) == pytest.approx(0.3)  # a cap at the device: unchanged
    assert e2e.capped_engine_share(True, 0.3, 2 * h200, h200) == pytest.approx(0.3)  # never scaled up
    # trl_turbo's automatic KV budget (a changed share would switch it off)
    assert e2e.capped_engine_share(False, 0.3, h100, h200) == 0.3


def test_e2e_child_failure_becomes_a_row(tmp_path):
    # On this machine the child cannot start vLLM (no GPU or no vLLM): the driver records why instead of raising
    spec = {"variant": "stock", "shape": "tiny", "checkpoint": str(tmp_path / "missing"), "output_dir": str(tmp_path),
            "generations": 2, "prompts": 1, "micro_batch": 2, "prompt_len": 4, "completion_len": 4, "steps": 1,
            "warmup": 0, "seed": 0,
            "quantization": "none", "launch": e2e.SINGLE_GPU, "processes": 1}
    row = e2e.run_child(spec, timeout_s=300)
    assert row["variant"] == "stock" and row["ok"] is False and row["error"]
    assert "timed out" not in row["error"], row["error"]  # failed fast, for its own reason
    stopped = e2e.run_child(spec, timeout_s=0.5)  # the child is still importing: stopped, and the row says so
    assert stopped["ok"] is False and stopped["error"].startswith("timed out"), stopped["error"]


def test_e2e_side_by_side_gives_each_variant_gpus_and_a_port_of_its_own(tmp_path, monkeypatch):
    assert e2e.side_by_side_devices([1, 2, 1], ["3", "5", "6", "7"]) == [["3"], ["5", "6"], ["7"]]
    with pytest.raises(SystemExit, match="needs 5 GPUs .* shows 4"):
        e2e.side_by_side_devices([2, 2, 1], ["0", "1", "2", "3"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert gpu_children.visible_devices(2) == ["4", "6"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpu_children.visible_devices(3) == ["0", "1", "2"]

    seen: list[dict[str, str]] = []

    def launch(command, *, env, **_):
        seen.append(env)
        return subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(e2e, "run_launch", launch)
    spec = {"variant": "turbo", "launch": e2e.SINGLE_GPU, "processes": 1}
    for devices in (["4", "5"], ["6", "7"]):
        assert e2e.run_child(spec, timeout_s=1, devices=devices)["ok"] is False
    assert [env["CUDA_VISIBLE_DEVICES"] for env in seen] == ["4,5", "6,7"]
    assert seen[0]["MASTER_PORT"] != seen[1]["MASTER_PORT"]
    assert seen[0]["UNSLOTH_COMPILE_LOCATION"] != seen[1]["UNSLOTH_COMPILE_LOCATION"]

    import argparse

    parser = argparse.ArgumentParser()
    e2e.add_parser(parser.add_subparsers())
    with pytest.raises(SystemExit, match="one after the other"):
        e2e.run(parser.parse_args(["e2e", "--shape", "tiny", "--gpu-gib", "5", "--side-by-side"]))


def test_e2e_ranks_merge_into_one_row_and_scaling_is_against_one_gpu():
    one = {**_e2e_row("turbo", 20.0, 29.0), "launch": e2e.SINGLE_GPU, "processes": 1, "rank": 0}
    rank0 = {**_e2e_row("turbo", 22.0, 30.0), "launch": "multi_gpu", "processes": 2, "rank": 0}
    rank1 = {**_e2e_row("turbo", 24.0, 31.0), "launch": "multi_gpu", "processes": 2, "rank": 1}
    merged = e2e.merge_ranks([rank1, rank0])
    assert merged["rank"] == 0 and merged["ok"]
    assert merged["peak_gib"] == 31.0 and merged["peak_gib_per_rank"] == [30.0, 31.0]
    assert merged["step_s"] == 24.0 and merged["step_s_per_rank"] == [22.0, 24.0]  # the slowest rank
    scaling = e2e.scaling([one, merged], completion_len=4096)
    assert scaling["multi_gpu/turbo"]["throughput_vs_1gpu"] == pytest.approx(2 * 20.0 / 24.0)
    assert scaling["multi_gpu/turbo"]["scaling_efficiency"] == pytest.approx(20.0 / 24.0)
    assert "throughput_vs_1gpu" not in scaling["1gpu/turbo"]
    command = e2e.launch_command("multi_gpu", 2)
    assert command[command.index("--num_processes") + 1] == "2" and command[-2:] == ["-m", "trl_turbo.bench.e2e"]
    assert int(command[command.index("--main_process_port") + 1]) > 0  # launches side by side do not collide
    with pytest.raises(SystemExit, match="no accelerate config"):
        e2e.launch_command("not_a_config", 2)


def test_e2e_profile_context_must_leave_the_probe_room_in_the_engines_context():
    import argparse

    parser = argparse.ArgumentParser()
    e2e.add_parser(parser.add_subparsers())
    args = parser.parse_args(["e2e", "--shape", "tiny", "--preset", "realistic", "--profile-decode", "8",
                              "--profile-context", "2000"])  # 64 + 2048 - 128 = 1984 at most
    with pytest.raises(SystemExit, match="at most 1984"):
        e2e.run(args)


def test_e2e_refuses_to_run_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="CUDA"):
        cli.main(["e2e", "--shape", "tiny", "--out", str(tmp_path)])


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_train_qlora(tmp_path):
    cli.main(["train", "--shape", "tiny", "--micro-batch", "2", "--lengths", "8", "--prompt-len", "4",
              "--quantization", "nf4", "--out", str(tmp_path)])
    data = _load_single(tmp_path, "train")
    assert data["config"]["quantization"]["load_in_4bit"] == "True"
    assert {row["quantization"] for row in data["rows"]} == {"nf4"} and all(row["ok"] for row in data["rows"])
    assert "| nf4 | 2 | 4 | 8 |" in results.render_table(tmp_path)


# -------------------------------------------------------------------------------------------------- cpu-step
@needs_turbo
def test_cpu_step_vlm_step_with_the_import(tmp_path):
    """One GRPO step of the tiny Gemma 3 VLM with trl_turbo patched in: the pictures reach the vision tower when
    sampling and in the training forward, and the step completes (any error in the VLM path raises here). A small
    vocabulary: under pytest trl_turbo's Triton kernels run in the interpreter, far too slow for 151,936 tokens."""
    import trl_turbo
    from trl_turbo.bench import cpu_step

    assert trl_turbo.patch()
    trainer = cpu_step.build_trainer("tiny-vlm", 512, str(tmp_path), steps=1, completion_len=8)
    assert trainer._is_vlm and "image" in trainer.train_dataset.column_names
    vision_calls = []
    trainer.model.model.vision_tower.register_forward_hook(lambda module, args, output: vision_calls.append(module))
    trainer.train()
    assert trainer.state.global_step == 1 and trl_turbo.is_patched()
    assert len(vision_calls) >= 2  # generation's prefill and the loss forward
    logged = trainer.state.log_history[0]
    assert logged["completions/mean_length"] > 0 and torch.isfinite(torch.tensor(logged["loss"]))


@needs_turbo
@pytest.mark.parametrize("variant", ["stock", "turbo"])
def test_cpu_step_child_runs_its_variant(variant):
    """The child is started inside trl_turbo's package (whose import patches TRL): stock must train unpatched."""
    from trl_turbo.bench import cpu_step

    child = cpu_step.run_child(variant, "tiny-llama", vocab=64, steps=0, completion_len=4)
    assert child["patched"] is (variant == "turbo")
    assert child["steps_run"] == 1 and child["step_s_all"] == [] and child["step_s"] is None


def test_e2e_turbo_set_overrides_the_turbo_variants_only():
    overrides = parse_turbo_overrides(["turbo_training_memory_gib=48", "turbo_vllm_kv_cache_dtype=fp8"])
    assert overrides == {"turbo_training_memory_gib": 48, "turbo_vllm_kv_cache_dtype": "fp8"}
    assert e2e.variant_config("stock", overrides) == e2e.VARIANT_CONFIG["stock"]
    turbo = e2e.variant_config("turbo-min", overrides)
    assert turbo == {**e2e.VARIANT_CONFIG["turbo-min"], **overrides}
    for bad in ("learning_rate=1", "turbo_training_memory_gib", "nonsense=2"):
        with pytest.raises(SystemExit, match="--turbo-set"):
            parse_turbo_overrides([bad])


def test_e2e_turbo_set_refuses_what_a_variant_sets_itself():
    import argparse

    parser = argparse.ArgumentParser()
    e2e.add_parser(parser.add_subparsers())
    args = parser.parse_args(["e2e", "--shape", "tiny", "--variants", "stock,turbo-min",
                              "--turbo-set", "turbo_memory_plan=auto"])
    with pytest.raises(SystemExit, match="turbo-min"):
        e2e.run(args)


def test_e2e_never_reports_a_warm_up_step_as_timed():
    import argparse

    parser = argparse.ArgumentParser()
    e2e.add_parser(parser.add_subparsers())
    with pytest.raises(SystemExit, match="leaves no timed step"):
        e2e.run(parser.parse_args(["e2e", "--shape", "tiny", "--steps", "1", "--warmup", "1"]))
    # a variant stopped after its warm-up keeps its peak, and no median of an untimed step
    steps = [{"step_s": 45.0, "generate_s": 20.0, "sync_s": 0.1, "peak_gib": 30.0}]
    summary = e2e.summarize(steps, warmup=1)
    assert summary["peak_gib"] == 30.0 and summary["step_s"] is None and summary["generate_s"] is None


def test_a_steps_peak_includes_what_came_before_it_since_start_up(monkeypatch):
    """accelerate prepares the model inside `train()`, before the first step begins (FSDP2 shards it there): that
    memory is part of the run's peak, not dropped between start-up and the first step."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    readings = iter([{"setup": 70 * 2**30}, {"train": 50 * 2**30}, {"between": 2**30},
                     {"train": 52 * 2**30}])
    sampler = SimpleNamespace(phase="setup", take_peaks=lambda: next(readings))
    callbacks, steps = [], []
    trainer = SimpleNamespace(vllm_generation=None, add_callback=callbacks.append)
    with e2e._instrument(trainer, sampler, steps, lambda: None):
        for _ in range(2):
            callbacks[0].on_step_begin(None, None, None)
            callbacks[0].on_step_end(None, None, None)
    assert [step["peak_gib"] for step in steps] == [70, 52]
    assert [step["before_peak_gib"] for step in steps] == [70, 1]
    assert e2e.summarize(steps, warmup=1)["peak_gib"] == 70  # the warm-up step's, preparation included


def test_e2e_runs_a_launch_at_several_gpu_counts_each_with_its_tensor_parallel_size():
    """`--processes 2,4 --vllm-tp all`: one command scales 1 -> 2 -> 4 GPUs, each launch's engine over its GPUs,
    each count's throughput against the 1gpu launch's."""
    import argparse

    parser = argparse.ArgumentParser()
    e2e.add_parser(parser.add_subparsers())
    args = parser.parse_args(["e2e", "--shape", "tiny", "--launches", "1gpu,fsdp2", "--processes", "2,4",
                              "--vllm-tp", "all"])
    assert args.processes == [2, 4] and [e2e.tp_size(args.vllm_tp, n) for n in (1, 2, 4)] == [1, 2, 4]
    assert e2e.tp_size(2, 4) == 2
    with pytest.raises(SystemExit, match="must divide --processes 2"):
        e2e.run(parser.parse_args(["e2e", "--shape", "tiny", "--launches", "fsdp2", "--processes", "2,4",
                                   "--vllm-tp", "4"]))
    with pytest.raises(SystemExit):  # neither a size nor "all"
        parser.parse_args(["e2e", "--shape", "tiny", "--vllm-tp", "0"])

    one = {**_e2e_row("turbo", 20.0, 29.0), "launch": e2e.SINGLE_GPU, "processes": 1}
    two = {**_e2e_row("turbo", 22.0, 30.0), "launch": "fsdp2", "processes": 2}
    four = {**_e2e_row("turbo", 25.0, 31.0), "launch": "fsdp2", "processes": 4}
    scaling = e2e.scaling([one, two, four], completion_len=4096)
    assert scaling["fsdp2x2/turbo"]["throughput_vs_1gpu"] == pytest.approx(2 * 20.0 / 22.0)
    assert scaling["fsdp2x4/turbo"]["scaling_efficiency"] == pytest.approx(20.0 / 25.0)
    assert "fsdp2/turbo" not in scaling and "1gpu/turbo" in scaling


def test_a_row_names_the_all_reduces_the_engines_tensor_parallel_group_brought_up(monkeypatch):
    import sys
    import types

    on, off = types.SimpleNamespace(disabled=False), types.SimpleNamespace(disabled=True)
    communicator = types.SimpleNamespace(qr_comm=None, fi_ar_comm=None, ca_comm=off, symm_mem_comm=on,
                                         pynccl_comm=on)
    group = types.SimpleNamespace(world_size=2, device_communicator=communicator)
    state = types.ModuleType("vllm.distributed.parallel_state")
    state.get_tp_group = lambda: group
    for name in ("vllm", "vllm.distributed"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", state)
    assert e2e.engine_all_reduces() == {"vllm_tp_all_reduces": ["symm_mem", "nccl"]}  # the custom one failed
    communicator.ca_comm = on
    assert e2e.engine_all_reduces()["vllm_tp_all_reduces"][0] == "custom"
    group.world_size = 1
    assert e2e.engine_all_reduces() == {}

    def no_group():
        raise AssertionError("tensor model parallel group is not initialized")

    state.get_tp_group = no_group
    assert e2e.engine_all_reduces() == {}
