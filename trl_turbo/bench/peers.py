"""The peer `bench e2e` measures beside stock TRL and trl_turbo: Unsloth, the single-GPU library our users would pick
instead.

Design decision: a peer runs the recipe its own documentation gives, on the same checkpoint, prompts, reward, batch,
LoRA rank and targets as the other variants, and is measured by the same code (`e2e.measure`). Unsloth pins another
TRL and datasets than trl_turbo's, so its child runs with a site directory of its own first on ``PYTHONPATH``
(``--unsloth-site``). It must be imported before transformers, TRL and peft, so the child is started by its file's
path (`unsloth_child.py`), not as a module of this package (whose import would load TRL first). Nothing of Unsloth
is imported here. What the variant cannot do is refused before the checkpoint is built: several GPUs (Unsloth trains
on one), a memory cap, full fine-tuning.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

# What each peer variant passes to Unsloth's `FastLanguageModel.from_pretrained` on top of the common arguments.
PEER_VARIANTS: dict[str, dict[str, Any]] = {
    "unsloth": {},
    "unsloth-fp8": {"load_in_fp8": True, "float8_kv_cache": True},  # its fp8 RL mode, with an fp8 KV cache
}
# Unsloth's documented setup for GRPO with its vLLM engine: standby (its own), statistics off (no network there),
# its compile cache out of the working tree.
UNSLOTH_ENV = {"UNSLOTH_VLLM_STANDBY": "1", "UNSLOTH_DISABLE_STATISTICS": "1",
               "UNSLOTH_COMPILE_LOCATION": "/tmp/unsloth_compiled_cache",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# The memory share its GRPO notebooks give vLLM; with standby Unsloth sets its own on large GPUs (recorded per row).
GPU_MEMORY_UTILIZATION = 0.9
# "all-linear" for the decoder families the bench shapes use, spelled as Unsloth's `get_peft_model` takes it.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VERSIONED = ("unsloth", "unsloth_zoo", "trl", "datasets", "transformers", "peft", "torch", "vllm", "bitsandbytes",
             "torchao", "xformers")


def is_peer(variant: str) -> bool:
    return variant in PEER_VARIANTS


def refusals(variants: list[str], launches: list[str], *, single_gpu: str, gpu_gib: float | None,
             full_finetuning: bool, vllm_tp: int, site: str | None, quantization: str = "none") -> list[str]:
    """Why the peer variants among `variants` cannot run as asked (empty: they can)."""
    peers = [variant for variant in variants if is_peer(variant)]
    if not peers:
        return []
    problems = []
    if launches != [single_gpu] or vllm_tp != 1:
        problems.append(f"{', '.join(peers)} train on one GPU: use --launches {single_gpu} and --vllm-tp 1")
    if gpu_gib is not None:
        problems.append(f"{', '.join(peers)} size vLLM's share of the GPU themselves: leave out --gpu-gib")
    if full_finetuning:
        problems.append(f"{', '.join(peers)} follow Unsloth's LoRA recipe: leave out --full-finetuning")
    fp8 = [variant for variant in peers if PEER_VARIANTS[variant].get("load_in_fp8")]
    if fp8 and quantization != "none":
        problems.append(f"{', '.join(fp8)} load the weights in fp8, not {quantization}: run them without "
                        "--quantization (and `unsloth` for the 4-bit row)")
    if not site or not Path(site).is_dir():
        problems.append(f"{', '.join(peers)} need Unsloth's own site directory (its TRL and datasets pins differ "
                        f"from trl_turbo's): pass --unsloth-site DIR or set TRL_TURBO_UNSLOTH_SITE "
                        f"({site or 'not set'})")
    return problems


def child_command(spec_path: str | Path) -> list[str]:
    return [sys.executable, str(Path(__file__).with_name("unsloth_child.py")), str(spec_path)]


def child_env(base: dict[str, str], site: str) -> dict[str, str]:
    """`base` with the peer's site directory first on PYTHONPATH and Unsloth's settings (the caller's own values
    of those settings win)."""
    path = os.pathsep.join(part for part in (site, base.get("PYTHONPATH", "")) if part)
    return {**UNSLOTH_ENV, **base, "PYTHONPATH": path}


def versions() -> dict[str, str | None]:
    """The installed versions the peer's row was measured with."""
    from ..versions import installed_version

    return {name: installed_version(name) for name in VERSIONED}
