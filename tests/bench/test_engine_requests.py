"""`bench e2e --engine-request`: in a turbo variant's child the candidate kernel's seam is installed and the engine
arguments trl_turbo hands vLLM gain its request, beside the run plan's own; stock-only commands are refused."""

from __future__ import annotations

import pytest

from trl_turbo import registry
from trl_turbo.bench import e2e, engine_requests
from trl_turbo.patches import trl_vllm
from trl_turbo.vllm import decode_attention, fp8_kernel


def test_the_engines_ask_for_the_requested_kernels_beside_the_plans_own_arguments(monkeypatch):
    installed = []
    monkeypatch.setattr(decode_attention, "install", lambda: installed.append("decode-attention"))
    monkeypatch.setattr(fp8_kernel, "install", lambda: installed.append("fp8-gemm"))
    monkeypatch.setattr(trl_vllm, "engine_kwargs", lambda *args, **kwargs: {"quantization": "fp8"})
    try:
        engine_requests.apply(["decode-attention", "fp8-gemm"])
        assert installed == ["decode-attention", "fp8-gemm"]
        assert trl_vllm.engine_kwargs(None, None, None, None, False) == {
            "quantization": "fp8", "additional_config": {decode_attention.ENGINE_KEY: decode_attention.PAGED_TRITON,
                                                         fp8_kernel.ENGINE_KEY: fp8_kernel.WEIGHT_ONLY_DECODE}}
    finally:
        registry.restore_attr(trl_vllm, "engine_kwargs")
    with pytest.raises(ValueError, match="unknown engine requests"):
        engine_requests.apply(["flash-decoding"])


def test_a_command_without_a_turbo_variant_or_fp8_sampling_for_the_fp8_gemm_is_refused(tmp_path):
    parser = e2e.argparse.ArgumentParser()
    e2e.add_parser(parser.add_subparsers())
    args = parser.parse_args(["e2e", "--shape", "llama-3.1-8b", "--variants", "stock", "--engine-request",
                              "decode-attention", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="add a turbo variant"):
        e2e.run(args)
    args = parser.parse_args(["e2e", "--shape", "llama-3.1-8b", "--variants", "stock,turbo", "--engine-request",
                              "fp8-gemm", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="add the turbo-fp8 variant"):  # the GEMM of fp8 sampling only
        e2e.run(args)


def test_each_row_says_which_requests_its_engine_made():
    spec = {"variant": "turbo-fp8", "shape": "llama-3.1-8b", "quantization": "none", "launch": "1gpu",
            "generations": 8, "prompts": 1, "micro_batch": 8, "prompt_len": 64, "completion_len": 512,
            "engine_requests": ["decode-attention"]}
    assert e2e.new_row(spec)["engine_requests"] == ["decode-attention"]
    assert e2e.new_row({**spec, "variant": "stock"})["engine_requests"] == []
    assert e2e.new_row({**spec, "variant": "unsloth"})["engine_requests"] == []
    assert e2e.new_row({key: value for key, value in spec.items() if key != "engine_requests"})[
        "engine_requests"] == []


def test_the_request_reaches_the_engine_trl_builds(monkeypatch):
    """Through trl_turbo's wrapper of TRL's `_init_vllm`, on a stand-in of TRL's module and its `LLM`."""
    import sys
    import types

    from trl_turbo import versions

    module = types.ModuleType("stand_in_trl_generation")
    module.LLM = lambda **kwargs: kwargs

    def init_vllm(self):
        self.llm = sys.modules[module.__name__].LLM(model="some/model", seed=0)

    init_vllm.__module__ = module.__name__
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(versions, "installed_version", lambda package: {"vllm": "0.24.0"}.get(package))
    monkeypatch.setattr(decode_attention, "install", lambda: None)
    generation = types.SimpleNamespace(mode="colocate", accelerator=types.SimpleNamespace(mixed_precision="bf16"))
    try:
        engine_requests.apply(["decode-attention"])
        trl_vllm._wrap_init_vllm(init_vllm)(generation)
    finally:
        registry.restore_attr(trl_vllm, "engine_kwargs")
    assert generation.llm["additional_config"] == {decode_attention.ENGINE_KEY: decode_attention.PAGED_TRITON}
    assert generation.llm["dtype"] == "bfloat16" and generation.llm["seed"] == 0  # the plan's and TRL's stay
