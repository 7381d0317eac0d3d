"""The `turbo_*` fields are real GRPOConfig fields: kwargs, HfArgumentParser CLI, TrlParser YAML, pickle, deepcopy,
validation before any model loads."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import re
from pathlib import Path

import pytest
import torch
from transformers import HfArgumentParser
from trl import GRPOConfig, TrlParser

import trl_turbo  # noqa: F401
from trl_turbo.config import TURBO_FIELDS, Settings

CPU = {"bf16": False, "use_cpu": True, "report_to": "none"}


def make(tmp_path, **kwargs) -> GRPOConfig:
    return GRPOConfig(output_dir=str(tmp_path), **CPU, **kwargs)


def test_every_field_is_a_documented_dataclass_field():
    fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    for turbo_field in TURBO_FIELDS:
        assert turbo_field.name in fields
        assert turbo_field.name.startswith("turbo_")
        assert len(turbo_field.metadata["help"]) > 30


def test_readme_field_table_is_generated_from_the_help_texts():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "scripts" / "field_table.py"
    spec = importlib.util.spec_from_file_location("field_table", path)
    field_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(field_table)
    readme = field_table.README.read_text()
    assert field_table.updated(readme) == readme, "README's field table is stale: run `python scripts/field_table.py`"
    for turbo_field in TURBO_FIELDS:
        assert f"| `{turbo_field.name}` |" in readme and turbo_field.metadata["help"][:40].replace("|", "\\|") in readme


ROOT = Path(__file__).resolve().parents[1]
MAX_CELL = 300


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_github_anchor_matches_githubs_rule():
    assert github_anchor("KV cache: standby and dtype") == "kv-cache-standby-and-dtype"
    assert github_anchor("Lean norms and Liger's layers") == "lean-norms-and-ligers-layers"
    assert github_anchor("`trl-turbo plan` and turbo_memory_plan") == "trl-turbo-plan-and-turbo_memory_plan"


def test_readme_field_table_cells_are_short():
    readme = (ROOT / "README.md").read_text()
    start, end = readme.index("<!-- fields:start"), readme.index("<!-- fields:end")
    rows = [line for line in readme[start:end].splitlines() if line.startswith("| `")]
    assert len(rows) == len(TURBO_FIELDS)
    for row in rows:
        for cell in re.split(r"(?<!\\)\|", row)[1:-1]:
            assert len(cell.strip()) <= MAX_CELL, f"README field table cell over {MAX_CELL} characters: {cell.strip()}"


def test_every_help_text_links_a_section_of_the_usage_guide():
    usage = (ROOT / "docs" / "usage.md").read_text()
    in_code = False
    anchors = set()
    for line in usage.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            anchors.add(github_anchor(line.lstrip("#")))
    for turbo_field in TURBO_FIELDS:
        links = re.findall(r"See docs/usage\.md#([\w-]+)\.$", turbo_field.metadata["help"])
        assert links, f"{turbo_field.name}'s help text does not end with 'See docs/usage.md#<section>.'"
        assert links[0] in anchors, f"{turbo_field.name} links docs/usage.md#{links[0]}, which has no such heading"


def test_kwargs_defaults_and_to_dict(tmp_path):
    config = make(tmp_path, turbo_logprob_chunk_tokens=256)
    assert config.turbo_fused_loss is True
    assert config.turbo_reuse_policy_logps is True
    assert config.turbo_logprob_chunk_tokens == 256
    assert config.to_dict()["turbo_logprob_chunk_tokens"] == 256
    assert "turbo_fused_loss=True" in repr(config)


def test_pickle_and_deepcopy_round_trip(tmp_path):
    config = make(tmp_path, turbo_fused_loss=False)
    for clone in (pickle.loads(pickle.dumps(config)), copy.deepcopy(config)):
        assert clone.turbo_fused_loss is False
        assert clone == config


def test_hf_argument_parser_cli(tmp_path):
    parser = HfArgumentParser(GRPOConfig)
    (config,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--bf16", "false", "--use_cpu", "true", "--report_to", "none",
         "--turbo_fused_loss", "false", "--turbo_logprob_chunk_tokens", "512"]
    )
    assert config.turbo_fused_loss is False
    assert config.turbo_logprob_chunk_tokens == 512


def test_trl_parser_yaml_and_cli_override(tmp_path):
    yaml_path = tmp_path / "config.yaml"
    yaml_path.write_text(
        f"output_dir: {tmp_path}\nbf16: false\nuse_cpu: true\nreport_to: none\n"
        "turbo_reuse_policy_logps: false\nturbo_logprob_chunk_tokens: 128\n"
    )
    parser = TrlParser((GRPOConfig,))
    (config,) = parser.parse_args_and_config(["--config", str(yaml_path), "--turbo_logprob_chunk_tokens", "64"])
    assert config.turbo_reuse_policy_logps is False
    assert config.turbo_logprob_chunk_tokens == 64


def test_unknown_loss_type_fails_at_config_time(tmp_path):
    with pytest.raises(ValueError, match="Unknown `loss_type='nope'`.*turbo_fused_loss=False"):
        make(tmp_path, loss_type="nope")


def test_unknown_is_mode_fails_at_config_time(tmp_path):
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        make(tmp_path, vllm_importance_sampling_mode="token_clip")


def test_liger_layers_need_liger_and_a_gpu(tmp_path, monkeypatch):
    import importlib.util

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA GPU.*turbo_liger_layers=False"):
            make(tmp_path, turbo_liger_layers=True)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "liger_kernel" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match=r"trl-turbo\[liger\]"):
        make(tmp_path, turbo_liger_layers=True)


def test_invalid_numbers_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="turbo_logprob_chunk_tokens"):
        make(tmp_path, turbo_logprob_chunk_tokens=0)
    with pytest.raises(ValueError, match="turbo_tiled_mlp_tokens"):
        make(tmp_path, turbo_tiled_mlp_tokens=0)
    for budget in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="turbo_offload_host_budget_gib"):
            make(tmp_path, turbo_offload_host_budget_gib=budget)
    assert make(tmp_path, turbo_offload_host_budget_gib=0.0).turbo_offload_host_budget_gib == 0.0
    for budget in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="turbo_training_memory_gib"):
            make(tmp_path, turbo_training_memory_gib=budget)
    assert make(tmp_path, turbo_training_memory_gib=48.0).turbo_training_memory_gib == 48.0
    for share in (-0.1, 1.5, float("nan"), "half"):
        with pytest.raises(ValueError, match="turbo_offload_optimizer_states.*between 0 .* and 1"):
            make(tmp_path, turbo_offload_optimizer_states=share)


def test_optimizer_state_share_takes_numbers_and_bools(tmp_path):
    """A share from kwargs, YAML and the command line; a bool (the field's earlier type) means all or none."""
    for value, share in ((True, 1.0), (False, 0.0), (0.4, 0.4), (1, 1.0)):
        assert Settings.of(make(tmp_path, turbo_offload_optimizer_states=value)).offload_optimizer_states == share
    yaml_path = tmp_path / "config.yaml"
    yaml_path.write_text(f"output_dir: {tmp_path}\nbf16: false\nuse_cpu: true\nreport_to: none\n"
                         "turbo_offload_optimizer_states: true\n")
    (config,) = TrlParser((GRPOConfig,)).parse_args_and_config(["--config", str(yaml_path)])
    assert Settings.of(config).offload_optimizer_states == 1.0
    for text, share in (("0.35", 0.35), ("true", 1.0), ("False", 0.0)):
        (config,) = HfArgumentParser(GRPOConfig).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--bf16", "false", "--use_cpu", "true", "--report_to", "none",
             "--turbo_offload_optimizer_states", text])
        assert Settings.of(config).offload_optimizer_states == share
    assert Settings.of(make(tmp_path, turbo_offload_optimizer_states="True")).offload_optimizer_states == 1.0


def test_training_memory_budget_needs_the_automatic_plan(tmp_path):
    for plan in ("min", "off"):
        with pytest.raises(ValueError, match="turbo_memory_plan='auto'"):
            make(tmp_path, turbo_memory_plan=plan, turbo_training_memory_gib=48.0)
    with pytest.raises(ValueError, match="gradient_checkpointing=False"):
        make(tmp_path, gradient_checkpointing=False, turbo_training_memory_gib=48.0)


def test_subclasses_existing_at_import_accept_the_fields(tmp_path):
    from trl.experimental.gmpo import GMPOConfig

    config = GMPOConfig(output_dir=str(tmp_path), **CPU, turbo_fused_loss=False)
    assert config.turbo_fused_loss is False


def test_stock_trl_still_validates_its_own_fields(tmp_path):
    with pytest.raises(ValueError, match="At least one of `vllm_importance_sampling_clip_min`"):  # TRL's message
        make(tmp_path, vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=None)


def test_help_texts_survive_argparse_formatting():
    for turbo_field in TURBO_FIELDS:
        assert "%" not in turbo_field.metadata["help"], f"argparse would %-format {turbo_field.name}'s help"


def test_liger_layers_default_is_on_only_for_one_cuda_process_with_liger(monkeypatch):
    import importlib.util
    import types

    from trl_turbo.run_plan import liger_layers_enabled

    def args(**overrides):
        return types.SimpleNamespace(**{"turbo_liger_layers": None, "use_cpu": False, "world_size": 1,
                                        **overrides})

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "liger_kernel" else real_find_spec(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert liger_layers_enabled(args()) is True
    assert liger_layers_enabled(args(world_size=2)) is False  # several processes: not measured with Liger yet
    assert liger_layers_enabled(args(use_cpu=True)) is False
    assert liger_layers_enabled(args(turbo_liger_layers=False)) is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert liger_layers_enabled(args()) is False
    assert liger_layers_enabled(args(turbo_liger_layers=True)) is True  # explicit: validation refuses it without CUDA
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "liger_kernel" else real_find_spec(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert liger_layers_enabled(args()) is False
