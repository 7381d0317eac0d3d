"""Offline stand-ins for the Hugging Face Hub repositories TRL's GRPO tests load, written into a throwaway cache.

Design decision: TRL's tests call ``from_pretrained("trl-internal-testing/...")`` and ``load_dataset(
"trl-internal-testing/zen", ...)``. Rather than redirecting those calls (a monkeypatch of transformers or datasets that
would sit in the code path under test), the stand-ins are written where the libraries' own offline mode looks:
models and tokenizers as Hub-cache snapshots (``<hub cache>/models--org--name/snapshots/<sha>/`` with
``refs/main``), data sets as prepared ``datasets`` caches (``<datasets cache>/org___name/<config>/0.0.0/<hash>/``,
which ``load_dataset`` reuses when ``HF_DATASETS_OFFLINE=1``). With ``HF_HUB_OFFLINE=1`` the tests then load them
through the unchanged loading code.

A model is its architecture's config shrunk to 2 layers of width 16 (as TRL's own tiny models are shrunk), randomly
initialised from a fixed seed and saved in bfloat16, as the Hub ones are. Its tokenizer is byte-level with no merges,
so any text round-trips, plus the special tokens of the family's real chat template, which is read at run time from
the templates TRL ships (``trl/chat_templates/*.jinja``); ids therefore differ from the real vocabularies, so tests
that hard-code real token ids fail with and without trl_turbo alike. Repositories not listed in ``MODELS`` (the
vision-language ones, whose processors need real vocabularies or torchvision, remote code, vLLM-sized checkpoints)
stay absent and their tests fail identically both ways. The data sets carry the columns of TRL's ``zen`` configs
(17 train and 2 test rows, as there), with this module's own text.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GenerationConfig,
    PreTrainedTokenizerFast,
)

ORG = "trl-internal-testing"
_SIZE: dict[str, Any] = {
    "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 4,
}
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}


@dataclass(frozen=True)
class Family:
    """A tokenizer family: its chat template (a file name in TRL's ``chat_templates``) and special tokens."""

    template: str
    eos: str
    pad: str
    bos: str | None = None


FAMILIES: dict[str, Family] = {
    "qwen2_5": Family("qwen2_5.jinja", eos="<|im_end|>", pad="<|endoftext|>"),
    "qwen3": Family("qwen3.jinja", eos="<|im_end|>", pad="<|endoftext|>"),
    "llama3_2": Family("llama3_2.jinja", eos="<|eot_id|>", pad="<|finetune_right_pad_id|>", bos="<|begin_of_text|>"),
    "gemma": Family("gemma.jinja", eos="<eos>", pad="<pad>", bos="<bos>"),
    "cohere2": Family("cohere2.jinja", eos="<|END_OF_TURN_TOKEN|>", pad="<PAD>", bos="<BOS_TOKEN>"),
    "glm4moe": Family("glm4moe.jinja", eos="<|endoftext|>", pad="<|endoftext|>"),
    "gptoss": Family("gptoss.jinja", eos="<|return|>", pad="<|endoftext|>"),
    "nemotron_3_nano": Family("nemotron_3_nano.jinja", eos="<|im_end|>", pad="<|endoftext|>"),
}


@dataclass(frozen=True)
class ModelStandIn:
    model_type: str
    family: str
    head: str = "causal_lm"  # or "sequence_classification"
    config: dict[str, Any] = field(default_factory=dict)


MODELS: dict[str, ModelStandIn] = {
    f"{ORG}/tiny-Qwen2ForCausalLM-2.5": ModelStandIn("qwen2", "qwen2_5"),
    f"{ORG}/tiny-Qwen2ForSequenceClassification-2.5": ModelStandIn("qwen2", "qwen2_5", "sequence_classification"),
    f"{ORG}/tiny-Qwen3ForCausalLM": ModelStandIn("qwen3", "qwen3"),
    f"{ORG}/tiny-Qwen3ForSequenceClassification": ModelStandIn("qwen3", "qwen3", "sequence_classification"),
    f"{ORG}/tiny-Qwen3MoeForCausalLM": ModelStandIn("qwen3_moe", "qwen3", config={**_MOE, "num_experts": 4}),
    f"{ORG}/tiny-LlamaForCausalLM-3.2": ModelStandIn("llama", "llama3_2"),
    f"{ORG}/tiny-LlamaForSequenceClassification-3.2": ModelStandIn("llama", "llama3_2", "sequence_classification"),
    f"{ORG}/tiny-Gemma2ForCausalLM": ModelStandIn("gemma2", "gemma"),
    f"{ORG}/tiny-Cohere2ForCausalLM": ModelStandIn("cohere2", "cohere2"),
    f"{ORG}/tiny-Glm4MoeForCausalLM": ModelStandIn(
        "glm4_moe", "glm4moe", config={**_MOE, "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
                                       "n_group": 1, "topk_group": 1, "use_qk_norm": True}),
    f"{ORG}/tiny-GptOssForCausalLM": ModelStandIn("gpt_oss", "gptoss", config={"num_local_experts": 4,
                                                                              "num_experts_per_tok": 2}),
    f"{ORG}/tiny-NemotronHForCausalLM-nano": ModelStandIn(
        "nemotron_h", "nemotron_3_nano",
        config={**_MOE, "layers_block_type": ["mamba", "attention", "moe"], "mamba_num_heads": 8, "mamba_head_dim": 4,
                "mamba_n_groups": 1, "ssm_state_size": 16, "mamba_d_conv": 4, "mamba_expand": 2,
                "n_routed_experts": 4, "moe_shared_expert_intermediate_size": 32, "use_mamba_kernels": False}),
}

DATASET_SPLITS = {"train": 17, "test": 2}
DATASETS = {f"{ORG}/zen": ("standard_prompt_only", "conversational_prompt_only")}
_SUBJECTS = ("rivers", "clocks", "maps", "bridges", "lanterns", "gardens", "ladders", "kettles", "compasses", "mirrors",
             "harbours", "windmills", "orchards", "violins", "glaciers", "chimneys", "meadows", "beacons", "quarries")
_SPECIAL_RE = re.compile(r"<\|[^|<>\s'\"]+\|>|<[A-Za-z_]+>|</[A-Za-z_]+>|\[gMASK\]|<sop>")


def _chat_template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / name).read_text(encoding="utf-8")


def build_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (256 byte tokens, no merges) with ``family``'s chat template and special tokens."""
    spec = FAMILIES[family]
    template = _chat_template(spec.template)
    named = [t for t in (spec.bos, spec.eos, spec.pad) if t]
    specials = list(dict.fromkeys(named + _SPECIAL_RE.findall(template)))
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(byte_chars)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # `<|...|>` markers are special (stripped by skip_special_tokens); tags such as <think> stay visible text.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials if t in named
                                or t.startswith("<|")])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in specials
                        if t not in named and not t.startswith("<|")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=spec.eos, pad_token=spec.pad,
                                        bos_token=spec.bos, clean_up_tokenization_spaces=False)
    tokenizer.chat_template = template
    return tokenizer


def _snapshot(hub_cache: Path, kind: str, repo_id: str) -> Path:
    """Create ``<hub_cache>/<kind>s--org--name/snapshots/<sha>`` and its ``refs/main``; return the snapshot dir."""
    repo = hub_cache / f"{kind}s--{repo_id.replace('/', '--')}"
    sha = hashlib.sha1(repo_id.encode()).hexdigest()
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(sha)
    snapshot = repo / "snapshots" / sha
    snapshot.mkdir(parents=True, exist_ok=True)
    return snapshot


def save_model(hub_cache: str | Path, repo_id: str, seed: int = 0) -> Path:
    """Write the stand-in of ``repo_id`` (a key of ``MODELS``) into ``hub_cache``; return its snapshot dir."""
    spec = MODELS[repo_id]
    tokenizer = build_tokenizer(spec.family)
    ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(getattr(tokenizer, f"{name}_token"))
           for name in ("bos", "eos", "pad") if getattr(tokenizer, f"{name}_token") is not None}
    settings = {**_SIZE, **spec.config, "vocab_size": len(tokenizer), **ids}
    if spec.head == "sequence_classification":
        settings["num_labels"] = 1
    config = AutoConfig.for_model(spec.model_type, **settings)
    auto = AutoModelForCausalLM if spec.head == "causal_lm" else AutoModelForSequenceClassification
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto.from_config(config, dtype=torch.bfloat16)
    snapshot = _snapshot(Path(hub_cache), "model", repo_id)
    model.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    if spec.head == "causal_lm":
        GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, **ids).save_pretrained(snapshot)
    return snapshot


def _prompts(config_name: str) -> dict[str, list]:
    texts = [f"A short note on {subject} begins with" for subject in _SUBJECTS]
    if config_name.startswith("conversational"):
        return {"prompt": [[{"role": "user", "content": f"Write a short note on {subject}."}] for subject in _SUBJECTS]}
    return {"prompt": texts}


def save_dataset(datasets_cache: str | Path, repo_id: str, config_name: str) -> None:
    """Prepare ``config_name`` of ``repo_id`` in ``datasets_cache`` as ``load_dataset`` offline expects to find it."""
    rows = _prompts(config_name)
    start = 0
    splits = {}
    for split, count in DATASET_SPLITS.items():
        splits[split] = datasets.Dataset.from_dict({k: v[start:start + count] for k, v in rows.items()})
        start += count
    tmp = Path(datasets_cache) / ".standin-src" / repo_id.replace("/", "--") / config_name
    files = {}
    for split, ds in splits.items():
        files[split] = str(tmp / f"{split}.parquet")
        tmp.mkdir(parents=True, exist_ok=True)
        ds.to_parquet(files[split])
    from datasets.packaged_modules.parquet.parquet import Parquet

    # Prepared under the bare name (a builder refuses local files under a Hub id), then moved to the Hub id's place.
    org, name = repo_id.split("/")
    builder = Parquet(cache_dir=str(tmp / "prepared"), dataset_name=name, config_name=config_name, data_files=files,
                      hash="standin")
    builder.download_and_prepare()
    target = Path(datasets_cache) / f"{org}___{name}" / config_name
    target.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(target / "0.0.0", ignore_errors=True)
    shutil.move(str(Path(builder.cache_dir).parent), target / "0.0.0")


def build_all(hf_home: str | Path) -> dict[str, list[str]]:
    """Populate ``hf_home`` (used as ``HF_HOME``) with every stand-in; return the model and data-set ids written."""
    hf_home = Path(hf_home)
    for repo_id in MODELS:
        save_model(hf_home / "hub", repo_id)
    for repo_id, configs in DATASETS.items():
        for config_name in configs:
            save_dataset(hf_home / "datasets", repo_id, config_name)
    (hf_home / "standins.json").write_text(json.dumps({"models": list(MODELS), "datasets": DATASETS}, indent=1))
    return {"models": list(MODELS), "datasets": [f"{r}:{c}" for r, cs in DATASETS.items() for c in cs]}
