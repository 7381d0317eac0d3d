"""The peer variants of `bench e2e` (Unsloth): what they refuse, how their child is started, and that the child
imports Unsloth before anything else. Unsloth itself runs only on the GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trl_turbo.bench import e2e, peers


def _refusals(tmp_path, **changes):
    asked = {"variants": ["stock", "unsloth"], "launches": [e2e.SINGLE_GPU], "single_gpu": e2e.SINGLE_GPU,
             "gpu_gib": None, "full_finetuning": False, "vllm_tp": 1, "site": str(tmp_path), **changes}
    variants, launches = asked.pop("variants"), asked.pop("launches")
    return peers.refusals(variants, launches, **asked)


def test_a_peer_runs_on_one_gpu_with_its_own_site(tmp_path):
    assert _refusals(tmp_path) == []
    assert _refusals(tmp_path, variants=["stock", "turbo"], site=None) == []  # no peer asked: nothing needed
    assert "--launches 1gpu" in _refusals(tmp_path, launches=["multi_gpu"])[0]
    assert "--vllm-tp 1" in _refusals(tmp_path, vllm_tp=2)[0]
    assert "--gpu-gib" in _refusals(tmp_path, gpu_gib=20.0)[0]
    assert "--full-finetuning" in _refusals(tmp_path, full_finetuning=True)[0]
    assert _refusals(tmp_path, quantization="nf4") == []  # Unsloth's own 4-bit row
    fp8 = _refusals(tmp_path, variants=["unsloth-fp8"], quantization="nf4")
    assert len(fp8) == 1 and "unsloth-fp8" in fp8[0] and "--quantization" in fp8[0]
    missing = _refusals(tmp_path, site=str(tmp_path / "absent"))
    assert len(missing) == 1 and "--unsloth-site" in missing[0] and "TRL_TURBO_UNSLOTH_SITE" in missing[0]


def test_peer_variants_are_bench_variants_with_their_own_settings():
    assert set(peers.PEER_VARIANTS) <= set(e2e.VARIANTS)
    assert e2e.variant_config("unsloth-fp8", {"turbo_memory_plan": "min"}) == peers.PEER_VARIANTS["unsloth-fp8"]
    assert not set(peers.PEER_VARIANTS) & set(e2e.VARIANT_CONFIG)  # never handed to TRL's GRPOConfig


def test_the_child_env_puts_the_peer_site_first(tmp_path):
    env = peers.child_env({"PYTHONPATH": "/repo", "UNSLOTH_VLLM_STANDBY": "0", "PATH": "/bin"}, str(tmp_path))
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/repo"]
    assert env["UNSLOTH_VLLM_STANDBY"] == "0" and env["UNSLOTH_DISABLE_STATISTICS"] == "1"  # the caller's wins
    command = peers.child_command("spec.json")
    assert command[0] == sys.executable and Path(command[1]).is_file() and command[2] == "spec.json"


def test_the_child_imports_unsloth_before_transformers_trl_and_peft(tmp_path):
    """With a stand-in `unsloth` first on the path (it stops the child), the child's first import finds none of the
    libraries Unsloth patches loaded yet, and the repository, not the child's own folder, already first on the
    path."""
    site = tmp_path / "site" / "unsloth"
    site.mkdir(parents=True)
    report = tmp_path / "report.json"
    site.joinpath("__init__.py").write_text(
        "import json, sys\n"
        f"json.dump([sorted(m for m in ('transformers', 'trl', 'peft', 'torch', 'trl_turbo') if m in sys.modules),"
        f" sys.path[0]], open({str(report)!r}, 'w'))\n"
        "raise SystemExit(0)\n")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({}))
    env = peers.child_env({k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, str(tmp_path / "site"))
    done = subprocess.run(peers.child_command(spec), env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(report.read_text()) == [[], str(Path(peers.__file__).resolve().parents[2])]


def test_a_peer_is_refused_before_anything_runs(tmp_path, monkeypatch):
    import argparse

    parser = argparse.ArgumentParser()
    e2e.add_parser(parser.add_subparsers())
    args = parser.parse_args(["e2e", "--shape", "tiny", "--variants", "stock,unsloth", "--launches", "multi_gpu",
                              "--unsloth-site", str(tmp_path), "--out", str(tmp_path)])
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    with pytest.raises(SystemExit, match="train on one GPU"):
        e2e.run(args)
