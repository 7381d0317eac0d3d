"""Liger-Kernel's fused RMSNorm and SwiGLU as per-module `forward` replacements.

Design decision: Liger's own autograd Functions (Triton kernels) are used as they are; only the call is ours, set on
module instances by `offload.install.install_liger_layers`, so it never leaks to other models in
the process and `trl_turbo.unpatch()` removes it. RoPE is left to transformers: Liger's RoPE can only be installed by
replacing the modeling module's global `apply_rotary_pos_emb`, which would change every model of that family in the
process, and rotary embedding is a negligible share of a step. The RMSNorm keeps Llama's casting (fp32 statistics,
normalised value rounded to the input dtype before the weight product) and does not overwrite its incoming gradient.
"""

from __future__ import annotations

import torch


class LigerRMSNormForward:
    """`forward` of a Llama-style RMSNorm (`weight * normalize(x)`) through Liger's fused kernel."""

    def __init__(self, module: torch.nn.Module) -> None:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        self.module = module
        self._function = LigerRMSNormFunction

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        module = self.module
        return self._function.apply(hidden_states, module.weight, module.variance_epsilon, 0.0, "llama", False)


class LigerSwiGLUForward:
    """`forward` of a gated SiLU MLP (`down(silu(gate(x)) * up(x))`), the SiLU-and-product fused by Liger."""

    def __init__(self, module: torch.nn.Module) -> None:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        self.module = module
        self._function = LigerSiLUMulFunction

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.module
        return mlp.down_proj(self._function.apply(mlp.gate_proj(x), mlp.up_proj(x)))
