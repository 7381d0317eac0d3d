"""Test-session setup that must happen before anything imports Triton.

Without a GPU, Triton kernels run under the interpreter (`TRITON_INTERPRET=1`), so the CPU suite — kernel tests and
trainer parity tests alike — exercises the same kernels the GPU runs. Triton reads the variable when a kernel is
decorated, i.e. at the first import of `trl_turbo.kernels`; conftest.py is imported before any test module.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # overrides an inherited "0": the CPU suite must run the kernels
