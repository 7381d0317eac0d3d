"""The random checkpoint written a decoder layer at a time (`bench/layerwise_checkpoint.py`): transformers loads the
4-bit one as a 4-bit model whose tensors are those its own 4-bit layers hold, and the 16-bit one as its own
16-bit model; neither ever holds the whole model (CPU, bitsandbytes' CPU kernels)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import needs_bnb

from trl_turbo.bench import layerwise_checkpoint
from trl_turbo.planning.shapes import QUANTIZATIONS, SHAPES, build_config


def _file_tensors(path):
    from safetensors import safe_open

    shapes = {}
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as handle:
            for key in handle.keys():
                shapes[key] = (tuple(handle.get_slice(key).get_shape()), handle.get_slice(key).get_dtype())
    return shapes


@needs_bnb
@pytest.mark.parametrize("shape", ["tiny", "qwen2.5-1.5b"])  # untied head; tied embeddings
def test_checkpoint_loads_as_transformers_own_4bit_model(shape, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    params = dict(SHAPES[shape])
    if shape != "tiny":  # the family's layout at a test size
        params.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=300)
    config = AutoConfig.for_model(params.pop("model_type"), **params)
    path = tmp_path / "ckpt"
    layerwise_checkpoint.save_layerwise_checkpoint(config, path, seed=0, device="cpu",
                                                   quantization=QUANTIZATIONS["nf4"], shard_bytes=20_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, and every tensor is in the index
    assert set(index["weight_map"]) == set(_file_tensors(path))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj).__name__ == "Linear4bit" and q_proj.weight.dtype == torch.uint8
    assert q_proj.weight.quant_state.quant_type == "nf4" and q_proj.weight.quant_state.nested  # double quantization
    logits = model(torch.tensor([[5, 6, 7]])).logits
    assert torch.isfinite(logits.float()).all() and logits.float().std() > 0
    # the same names, shapes and dtypes as transformers' own 4-bit layers hold for this config
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    reference.save_pretrained(tmp_path / "bf16")
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path / "bf16", dtype=torch.bfloat16, quantization_config=BitsAndBytesConfig(**QUANTIZATIONS["nf4"]))
    dtype_names = {torch.bfloat16: "BF16", torch.uint8: "U8", torch.float32: "F32"}
    expected = {name: (tuple(t.shape), dtype_names[t.dtype]) for name, t in reference.state_dict().items()
                if not (config.tie_word_embeddings and name == "lm_head.weight")}
    written = _file_tensors(path)
    state_blob = "quant_state.bitsandbytes__nf4"  # a JSON text whose length varies with its numbers
    assert written.keys() == expected.keys()
    assert {n: s for n, s in written.items() if state_blob not in n} == {
        n: s for n, s in expected.items() if state_blob not in n}
    # config.json: what save_pretrained writes for the model (vLLM picks its class by `architectures`) plus the
    # quantization; the caller's config is left as it was
    saved = json.loads((path / "config.json").read_text())
    assert saved["architectures"] == [type(reference).__name__]
    assert saved["quantization_config"]["quant_method"] == "bitsandbytes"
    assert getattr(config, "quantization_config", None) is None


def _count_materialised_layers(monkeypatch):
    """Record each module the writer materialises (`live`) and the most decoder layers off the meta device at once
    (`most[0]`)."""
    live, most = [], [0]
    materialise = layerwise_checkpoint._materialise

    def counting(module, model, device):
        materialise(module, model, device)
        live.append(module)
        layers = [m for m in live if any(p.device.type != "meta" for p in m.parameters())]
        most[0] = max(most[0], sum(1 for m in layers if type(m).__name__.endswith("DecoderLayer")))
        return module

    monkeypatch.setattr(layerwise_checkpoint, "_materialise", counting)
    return live, most


@needs_bnb
def test_one_decoder_layer_at_a_time(tmp_path, monkeypatch):
    live, most = _count_materialised_layers(monkeypatch)
    config = build_config("tiny")
    config.num_hidden_layers = 4
    layerwise_checkpoint.save_layerwise_checkpoint(config, tmp_path, seed=0, device="cpu",
                                                   quantization=QUANTIZATIONS["nf4"])
    assert sum(type(m).__name__.endswith("DecoderLayer") for m in live) == 4 and most[0] == 1


@needs_bnb
def test_e2e_saves_a_4bit_run_checkpoint_already_quantized(tmp_path):
    from trl_turbo.bench import e2e

    e2e.prepare_checkpoint("tiny", tmp_path, seed=0, device="cpu")  # 16-bit first, in the same folder
    assert (tmp_path / "model.safetensors").exists()
    identity = e2e.prepare_checkpoint("tiny", tmp_path, seed=0, device="cpu", quantization="nf4")
    assert identity["quantization"] == "nf4"
    assert not (tmp_path / "model.safetensors").exists()  # it would shadow the sharded 4-bit files
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["bnb_4bit_quant_type"] == "nf4"
    assert len(e2e.load_tokenizer(tmp_path)(e2e.prompts(1, 4, 512, seed=0)[0]).input_ids) == 4
    assert e2e.prepare_checkpoint("tiny", tmp_path, seed=0, device="cpu", quantization="nf4") == identity  # reused
    # every variant loads it as the trainer does: 4-bit from its own config (a second, dict config is refused)
    from transformers import AutoModelForCausalLM

    kwargs = {**e2e.MODEL_INIT_KWARGS, "dtype": getattr(torch, e2e.MODEL_INIT_KWARGS["dtype"])}
    assert AutoModelForCausalLM.from_pretrained(tmp_path, **kwargs).is_loaded_in_4bit


def test_building_a_shape_leaves_the_table_unchanged():
    import copy

    before = copy.deepcopy(SHAPES)
    for shape in ("llama-3.1-8b", "llama-3.3-70b"):
        build_config(shape)
    assert SHAPES == before  # else a checkpoint's identity drifts and it is rebuilt in every process


@pytest.mark.parametrize("shape", ["tiny", "qwen2.5-1.5b"])  # untied head; tied embeddings
def test_a_16bit_checkpoint_written_a_layer_at_a_time_is_transformers_own(shape, tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM

    params = dict(SHAPES[shape])
    if shape != "tiny":
        params.update(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=300)
    config = AutoConfig.for_model(params.pop("model_type"), **params)
    live, most = _count_materialised_layers(monkeypatch)
    path = tmp_path / "ckpt"
    layerwise_checkpoint.save_layerwise_checkpoint(config, path, seed=0, device="cpu", shard_bytes=20_000)
    assert most[0] == 1 and getattr(config, "quantization_config", None) is None
    saved = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in saved
    model = AutoModelForCausalLM.from_pretrained(path)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert {n: (tuple(t.shape), t.dtype) for n, t in model.state_dict().items()} == {
        n: (tuple(t.shape), t.dtype) for n, t in reference.state_dict().items()}
    assert set(_file_tensors(path)) == {n for n in reference.state_dict()
                                        if not (config.tie_word_embeddings and n == "lm_head.weight")}
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    assert q_proj.dtype == torch.bfloat16 and q_proj.float().std() > 0  # initialised, as from_config would
    logits = model(torch.tensor([[5, 6, 7]])).logits
    assert torch.isfinite(logits.float()).all()


def test_e2e_writes_a_model_larger_than_the_gpu_a_layer_at_a_time(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from trl_turbo.bench import e2e

    config = build_config("tiny")
    size = sum(p.numel() * 2 for p in AutoModelForCausalLM.from_config(config).parameters())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (size, 4 * size))
    assert e2e.whole_model_fits(config, "cuda", headroom=1.0)
    assert not e2e.whole_model_fits(config, "cuda", headroom=0.5)
    assert e2e.whole_model_fits(config, "cpu", headroom=0.0)
    written = []
    monkeypatch.setattr(e2e, "whole_model_fits", lambda config, device: False)
    monkeypatch.setattr(e2e, "save_layerwise_checkpoint", lambda *args, **kwargs: written.append(args))
    identity = e2e.prepare_checkpoint("tiny", tmp_path, seed=0, device="cpu")
    assert len(written) == 1 and written[0][1] == tmp_path and written[0][4] is None  # 16-bit
    assert identity["writer"] == "layerwise"
    # the same seed written whole on a device it fits is another checkpoint: rebuilt, not reused
    monkeypatch.setattr(e2e, "whole_model_fits", lambda config, device: True)
    assert e2e.prepare_checkpoint("tiny", tmp_path, seed=0, device="cpu")["writer"] == "whole"
    assert (tmp_path / "model.safetensors").exists() and len(written) == 1
