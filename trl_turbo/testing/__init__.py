"""Offline test bed: a tiny character-level chat tokenizer and tiny random-weight models of real architectures
(text-only in :mod:`.models`, a vision-language model with its processor in :mod:`.vlm`).

Design decision: nothing here touches the Hugging Face Hub, so tests, examples and benchmarks run without network and
reproduce bit-for-bit from a seed.
"""

from trl_turbo.testing.models import ARCHITECTURES, tiny_model, tiny_model_dir
from trl_turbo.testing.tokenizer import build_tokenizer

__all__ = ["ARCHITECTURES", "build_tokenizer", "tiny_model", "tiny_model_dir"]
