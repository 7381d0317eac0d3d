"""A tiny, randomly initialised vision-language model (Gemma 3) with its processor and an image dataset, built offline.

Design decision: the architecture is Gemma 3 (``Gemma3ForConditionalGeneration``: a SigLIP vision tower, an average-
pooling projector and the ``gemma3_text`` decoder) because it is one of the families TRL's GRPOTrainer feeds images to
and the simplest of those whose processor can be built here: the Qwen2-VL, Qwen2.5-VL and SmolVLM processors require a
video processor, which needs torchvision (not installed); Idefics3's would do, but it tiles every image, processor
work that adds nothing to measure here.
The processor is ``Gemma3Processor`` over the testbed tokenizer (:mod:`trl_turbo.testing.tokenizer`) with Gemma 3's
three image tokens added by name, and the PIL-backed ``Gemma3ImageProcessorPil`` with explicit arguments (56×56
images, 4×4 patches of 14 pixels pooled to ``IMAGE_TOKENS`` = 4 soft tokens per image); the chat template is the
testbed's, rendering an image part as ``<start_of_image>``, which the processor expands to the full image sequence.
The config comes from ``AutoConfig.for_model("gemma3", ...)`` so the modelling code is exactly the library's; the text
decoder is shrunk as :func:`trl_turbo.testing.models.tiny_model` shrinks ``gemma3_text`` but keeps a real vocabulary
size (Qwen's 151,936 by default), so the LM head dominates a CPU step as in the text-only benchmark row.
The dataset is the arithmetic task's prompts with an ``image`` column of seeded random-noise pictures (the column
TRL turns into an image part of the user turn).
"""

from __future__ import annotations

from typing import Any

import datasets
import numpy as np
import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText, Gemma3Processor, PreTrainedModel
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from trl_turbo.tasks import arithmetic
from trl_turbo.testing.models import HEAD_DIM
from trl_turbo.testing.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_tokenizer

IMAGE_SIZE = 56
PATCH_SIZE = 14
IMAGE_TOKENS = 4  # (56 / 14)² = 16 patches, average-pooled 2×2 into 4 soft tokens
IMAGE_TOKEN_NAMES = {
    "boi_token": "<start_of_image>",
    "image_token": "<image_soft_token>",
    "eoi_token": "<end_of_image>",
}
QWEN_VOCAB = 151_936

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '" + IMAGE_TOKEN_NAMES["boi_token"] + "' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_vlm_processor() -> Gemma3Processor:
    """The testbed tokenizer with Gemma 3's image tokens and a 56×56 PIL image processor, as a ``Gemma3Processor``."""
    tokenizer = build_tokenizer(IMAGE_TOKEN_NAMES)
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = Gemma3ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_pan_and_scan=False, image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )
    return Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE,
                           image_seq_length=IMAGE_TOKENS)


def tiny_vlm(
    processor: Gemma3Processor,
    *,
    vocab_size: int = QWEN_VOCAB,
    hidden_size: int = 64,
    layers: int = 2,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PreTrainedModel:
    """A random-init ``Gemma3ForConditionalGeneration`` whose image-token ids are ``processor``'s."""
    tokenizer = processor.tokenizer
    heads = hidden_size // HEAD_DIM
    special_ids = {"pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID}
    text_config = {
        "vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads // 2,
        "head_dim": HEAD_DIM, "query_pre_attn_scalar": HEAD_DIM, "sliding_window": 16,
        "max_position_embeddings": 512, **special_ids,
    }
    vision_config = {
        "model_type": "siglip_vision_model", "hidden_size": hidden_size // 2, "intermediate_size": hidden_size,
        "num_hidden_layers": layers, "num_attention_heads": 4, "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE,
    }
    config = AutoConfig.for_model(
        "gemma3", text_config=text_config, vision_config=vision_config, mm_tokens_per_image=IMAGE_TOKENS,
        boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id,
        image_token_index=tokenizer.image_token_id, **special_ids,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    for name, value in special_ids.items():
        setattr(model.generation_config, name, value)
    return model


def random_images(count: int, seed: int = 0) -> list[Image.Image]:
    """``count`` RGB noise pictures of ``IMAGE_SIZE`` pixels a side, drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)) for _ in range(count)]


def image_dataset(size: int, seed: int = 0) -> datasets.Dataset:
    """The first ``size`` arithmetic training prompts, each with a random picture in an ``image`` column."""
    rows: dict[str, Any] = arithmetic.load_dataset("train").select(range(size)).to_dict()
    return datasets.Dataset.from_dict({**rows, "image": random_images(size, seed)})
