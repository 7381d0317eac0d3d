"""Test-session setup that must happen before anything imports Triton.

Without a GPU, Triton kernels run under the interpreter (`TRITON_INTERPRET=1`), so the CPU suite — kernel tests and
trainer parity tests alike — exercises the same kernels the GPU runs. Triton reads the variable when a kernel is
decorated, i.e. at the first import of `trl_turbo.kernels`; conftest.py is imported before any test module.
"""

import os
import sys

import torch

# `helpers`, shared by test modules in every subfolder. No subfolder may be named like an importable package (vLLM's
# tests live in `sampler/`): with this folder on the path, a `vllm/` here would shadow vLLM.
sys.path.insert(0, os.path.dirname(__file__))

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # overrides an inherited "0": the CPU suite must run the kernels
