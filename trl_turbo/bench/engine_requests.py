"""Engines that ask for one of trl_turbo's candidate kernels inside vLLM (`vllm.decode_attention`, `vllm.fp8_kernel`):
`bench engine-options` builds them alone (`installed`), and `bench e2e --engine-request NAME` has the turbo
variants' engines ask (`apply`), so that a kernel which won alone is measured in whole GRPO steps before the run plan
asks for it.

Design decision: a benchmark's lever, not a GRPOConfig field: nothing a user sets selects a candidate that has not
won. In the variant's child process the kernel's seam is installed and the engine arguments trl_turbo hands vLLM
gain the request (`vllm.engine_request.combined`), for the rest of that process.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from .. import registry
from ..vllm import engine_request

# request name -> the module of its seam, under trl_turbo.vllm
REQUESTS = {"decode-attention": "decode_attention", "fp8-gemm": "fp8_kernel"}


def installed(names: Sequence[str]) -> list[dict[str, Any]]:
    """Install the seams of `names` (vLLM must not have built an engine yet); their engine arguments."""
    unknown = sorted(set(names) - set(REQUESTS))
    if unknown:
        raise ValueError(f"unknown engine requests {unknown}; choose from {sorted(REQUESTS)}")
    seams = [importlib.import_module(f"trl_turbo.vllm.{REQUESTS[name]}") for name in names]
    for seam in seams:
        seam.install()
    return [seam.engine_arguments() for seam in seams]


def apply(names: Sequence[str]) -> None:
    """Install the seams of `names` and make every engine trl_turbo builds in this process ask for them."""
    from ..patches import trl_vllm

    requests = installed(names)
    planned = trl_vllm.engine_kwargs

    def with_requests(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return engine_request.combined(planned(*args, **kwargs), *requests)

    registry.set_attr(trl_vllm, "engine_kwargs", with_requests)
