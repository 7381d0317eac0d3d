"""`trl-turbo grpo ...` behaves like `trl grpo ...` with trl_turbo patched in the training process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from trl_turbo.tasks import arithmetic
from trl_turbo.testing import tiny_model_dir

PROBE = textwrap.dedent(
    """
    import json, os
    import trl_turbo
    from trl import GRPOConfig

    def probe_reward(completions, **kwargs):
        with open(os.environ["TURBO_PROBE_OUT"], "w") as f:
            json.dump({"patched": trl_turbo.is_patched(),
                       "has_field": "turbo_fused_loss" in GRPOConfig.__dataclass_fields__}, f)
        return [float(len(str(c))) for c in completions]
    """
)


def _cli(*args: str, cwd, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trl_turbo.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_help_lists_turbo_fields(tmp_path):
    result = _cli("grpo", "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "--turbo_fused_loss" in result.stdout and "--turbo_reuse_policy_logps" in result.stdout


@pytest.mark.slow
def test_grpo_command_trains_with_trl_turbo_in_the_child_process(tmp_path):
    model_dir = tiny_model_dir("llama", tmp_path / "model")
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    arithmetic.load_dataset("train").select(range(16)).to_json(str(data_dir / "train.jsonl"))
    (tmp_path / "probe.py").write_text(PROBE)
    config = tmp_path / "grpo.yaml"
    config.write_text(
        textwrap.dedent(
            f"""
            model_name_or_path: {model_dir}
            dataset_name: {data_dir}
            reward_funcs: [probe.probe_reward]
            output_dir: {tmp_path / "out"}
            max_steps: 1
            per_device_train_batch_size: 4
            num_generations: 4
            max_completion_length: 4
            use_cpu: true
            bf16: false
            report_to: none
            save_strategy: "no"
            turbo_logprob_chunk_tokens: 64
            """
        )
    )
    env = dict(os.environ, TURBO_PROBE_OUT=str(tmp_path / "probe.json"), ACCELERATE_USE_CPU="true")
    result = _cli("grpo", "--config", str(config), "--turbo_reuse_policy_logps", "false", cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert json.loads((tmp_path / "probe.json").read_text()) == {"patched": True, "has_field": True}
