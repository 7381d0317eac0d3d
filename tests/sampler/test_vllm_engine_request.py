"""Engine requests for trl_turbo's kernels (`trl_turbo.vllm.engine_request`): each kernel's entry of
`additional_config`, combined with other engine arguments without replacing another kernel's entry."""

from __future__ import annotations

import types

from trl_turbo.vllm import decode_attention, engine_request, fp8_kernel


def test_requests_combine_in_one_additional_config_and_are_read_back_per_key():
    fp8 = {"quantization": "fp8", "kv_cache_dtype": "fp8"}
    both = engine_request.combined(fp8, fp8_kernel.engine_arguments(), decode_attention.engine_arguments())
    assert both == {"quantization": "fp8", "kv_cache_dtype": "fp8",
                    "additional_config": {fp8_kernel.ENGINE_KEY: fp8_kernel.WEIGHT_ONLY_DECODE,
                                          decode_attention.ENGINE_KEY: decode_attention.PAGED_TRITON}}
    config = types.SimpleNamespace(**both)
    assert engine_request.asked(config, fp8_kernel.ENGINE_KEY, fp8_kernel.WEIGHT_ONLY_DECODE)
    assert engine_request.asked(config, decode_attention.ENGINE_KEY, decode_attention.PAGED_TRITON)
    assert not engine_request.asked(types.SimpleNamespace(**fp8), fp8_kernel.ENGINE_KEY, fp8_kernel.WEIGHT_ONLY_DECODE)
    assert not engine_request.asked(types.SimpleNamespace(additional_config=None), "key", "value")
    first = fp8_kernel.engine_arguments()
    engine_request.combined(first, decode_attention.engine_arguments())
    assert first == fp8_kernel.engine_arguments()  # the inputs are left as they were


def test_a_missing_config_counts_as_none_and_a_conflict_or_a_non_dict_is_refused():
    import pytest

    assert engine_request.combined({"additional_config": None}, fp8_kernel.engine_arguments()) == \
        fp8_kernel.engine_arguments()
    assert engine_request.combined(fp8_kernel.engine_arguments(), fp8_kernel.engine_arguments()) == \
        fp8_kernel.engine_arguments()  # the same request twice is one
    with pytest.raises(ValueError, match="asked as"):
        engine_request.combined(fp8_kernel.engine_arguments(),
                                engine_request.arguments(fp8_kernel.ENGINE_KEY, "something else"))
    with pytest.raises(TypeError, match="must be a dict"):
        engine_request.combined({"additional_config": "json text"}, fp8_kernel.engine_arguments())
