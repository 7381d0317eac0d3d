"""A tiny, offline, character-level chat tokenizer for tests and toy GRPO runs.

Design decision: the vocabulary is only what the arithmetic task needs (digits, operators, parentheses, space,
newline), the two answer tags as *single, non-special* tokens, and a handful of special tokens (pad/bos/eos/unk and
the role markers). It is built in-process with the ``tokenizers`` library, so nothing is downloaded, the ids are
fixed (``PAD_ID``/``BOS_ID``/``EOS_ID`` below, which :mod:`trl_turbo.testing.models` uses for model configs) and the
result is deterministic. A vocabulary of 27 tokens lets a randomly initialised policy hit ``<answer>`` often enough
for GRPO to learn the format within a few dozen steps. The answer tags are not special on purpose: TRL decodes
completions with ``skip_special_tokens=True``, which would otherwise strip them before the reward functions see them.
Characters are spelled byte-level (space is ``Ġ``) and the tags are added tokens, so the saved tokenizer encodes the
same when ``AutoTokenizer`` reloads it as a model-specific class that rebuilds a byte-level BPE pipeline (transformers
5 does this for ``qwen2`` directories). Characters outside the vocabulary encode to ``<unk>``. A vision-language
processor can ask for named special tokens (e.g. Gemma 3's ``boi_token``/``image_token``/``eoi_token``): they get the
ids after ``VOCAB``, so every text-only id stays as it is, and become attributes (``tokenizer.boi_token_id``) the way
transformers exposes a model's own named tokens.
"""

from __future__ import annotations

from collections.abc import Mapping

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, *ROLE_TOKENS)
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
CHARACTERS = tuple("0123456789+-*=() \n")
# Vocabulary entries are byte-level spellings (space is "Ġ", newline "Ċ"), as in GPT-2-style tokenizers.
_BYTE_LEVEL = {" ": "\u0120", "\n": "\u010a"}
VOCAB: tuple[str, ...] = (*SPECIAL_TOKENS, ANSWER_OPEN, ANSWER_CLOSE, *(_BYTE_LEVEL.get(c, c) for c in CHARACTERS))
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tokenizer(named_tokens: Mapping[str, str] | None = None) -> PreTrainedTokenizerFast:
    """Return the testbed tokenizer (vocab size ``len(VOCAB)``, chat template, pad/bos/eos set, left padding).

    ``named_tokens`` (attribute name ending in ``_token`` -> token text) adds special tokens with ids from
    ``len(VOCAB)`` on, in the mapping's order, reachable as ``tokenizer.<name>`` and ``tokenizer.<name>_id``.
    """
    named_tokens = dict(named_tokens or {})
    if not all(name.endswith("_token") for name in named_tokens):
        raise ValueError(f"named token attributes must end in '_token', got {sorted(named_tokens)}")
    vocab = {token: index for index, token in enumerate(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # The tags are registered as added tokens so they stay atomic even in tokenizer classes that rebuild the
    # pre-tokenizer on load; every other character (newline included) is its own piece.
    backend.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in (ANSWER_OPEN, ANSWER_CLOSE)])
    backend.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in named_tokens.values()])
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
        padding_side="left",
        clean_up_tokenization_spaces=False,
        **named_tokens,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer

