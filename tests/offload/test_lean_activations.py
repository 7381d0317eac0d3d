"""`offload.lean_activations`: a kept layer stores each value once and rebuilds the MLP product, with values and
gradients bitwise those of plain autograd (real LoRA layers of the llama and gemma2 families, under bf16 autocast as
TRL trains them, and with 16-bit adapters as TRL's QLoRA sets them)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

from trl_turbo.offload.install import install_lean_norms
from trl_turbo.offload.lean_activations import cast_source, lean_saved_tensors
from trl_turbo.offload.memory_plan import kept_layer
from trl_turbo.offload.tiled_mlp import TiledMLPForward

TOKENS = 64
SHAPE = dict(hidden_size=128, intermediate_size=448, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, head_dim=32)


def _layer(family: str, adapter_dtype: torch.dtype | None):
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    else:
        model = Gemma2ForCausalLM(Gemma2Config(**SHAPE, attn_implementation="eager"))
    model = get_peft_model(model.to(torch.bfloat16), LoraConfig(r=8, target_modules="all-linear"))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)  # a live adapter: every LoRA path carries gradient
        if adapter_dtype is not None and param.requires_grad:
            param.data = param.data.to(adapter_dtype)
    if family == "llama":
        install_lean_norms(model)
    return model, model.base_model.model.model


def _run(model, inner, lean: bool, autocast: bool):
    layer = inner.layers[0]
    if lean:
        layer.mlp.forward = TiledMLPForward(layer.mlp, None, True)
    else:
        layer.mlp.__dict__.pop("forward", None)
    hidden = torch.randn(1, TOKENS, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    hidden.requires_grad_()
    positions = torch.arange(TOKENS)[None]
    embeddings = inner.rotary_emb(hidden, positions)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if lean:
            with lean_saved_tensors(params) as stored, kept_layer():
                out = layer(hidden, position_embeddings=embeddings, attention_mask=None, position_ids=positions)
            stored_bytes = stored[0]
        else:
            sizes = {}

            def pack(tensor):
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in params:
                    sizes[storage.data_ptr()] = storage.nbytes()
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                out = layer(hidden, position_embeddings=embeddings, attention_mask=None, position_ids=positions)
            stored_bytes = sum(sizes.values())
    out = out[0] if isinstance(out, tuple) else out
    out.float().pow(2).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.detach(), hidden.grad, grads, stored_bytes


@pytest.mark.parametrize(("family", "adapter_dtype", "autocast", "most_stored"), [
    ("llama", None, True, 0.70),  # fp32 adapters (PEFT's default) under bf16 autocast: TRL's LoRA
    ("llama", torch.bfloat16, False, 0.80),  # 16-bit adapters, no casts: TRL's QLoRA
    ("gemma2", None, True, 0.85),  # gemma's norms keep their fp32 copies; the MLP and copies still go
], ids=["llama-autocast", "llama-bf16-adapter", "gemma2-autocast"])
def test_a_kept_layer_stores_less_with_bitwise_gradients(family, adapter_dtype, autocast, most_stored):
    model, inner = _layer(family, adapter_dtype)
    plain = _run(model, inner, lean=False, autocast=autocast)
    lean = _run(model, inner, lean=True, autocast=autocast)
    assert torch.equal(plain[0], lean[0]) and torch.equal(plain[1], lean[1])
    assert plain[2].keys() == lean[2].keys() and len(plain[2]) == 14  # every LoRA A and B of the layer
    for name in plain[2]:
        assert torch.equal(plain[2][name], lean[2][name]), name
    assert lean[3] <= most_stored * plain[3], (lean[3], plain[3])


def test_only_value_preserving_cast_chains_count_as_copies():
    bf16 = torch.randn(8, dtype=torch.bfloat16, requires_grad=True) * 1  # a non-leaf source
    widened = bf16.to(torch.float32)
    assert cast_source(widened)[0] is bf16.grad_fn  # bf16 -> fp32: exact
    assert cast_source(widened.to(torch.bfloat16).view(2, 4))[2] == 2  # and back, then a view: still exact
    narrowed = (torch.randn(8, requires_grad=True) * 1).to(torch.bfloat16)
    assert cast_source(narrowed)[2] == 0  # fp32 -> bf16 rounds: only the cast's own output is the source
    lossy = bf16.to(torch.float16).to(torch.bfloat16)
    assert cast_source(lossy)[2] < 2  # bf16 -> fp16 can overflow or round: not a copy of the bf16 source
    assert cast_source(bf16 + 1)[2] == 0  # no cast at all


def test_copies_of_one_source_are_stored_once():
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True) * 1
    weights = [torch.randn(8, 8, requires_grad=True) for _ in range(3)]
    excluded = {w.untyped_storage().data_ptr() for w in weights}
    with lean_saved_tensors(excluded) as stored:
        outs = [x.to(torch.float32) @ w for w in weights]  # three fp32 copies of x, one per matmul
    assert stored[0] == 4 * 8 * 4  # one of them stored
    sum(o.sum() for o in outs).backward()
    expected = [x.detach().float().t() @ torch.ones(4, 8) for _ in weights]
    assert all(torch.equal(w.grad, e) for w, e in zip(weights, expected))


def test_the_graph_api_the_matching_reads_is_there():
    """`_input_metadata` (each node's output dtypes) is private torch API: without it no copy or product would match,
    silently. This fails loudly instead."""
    source = torch.randn(4, dtype=torch.bfloat16, requires_grad=True) * 1
    copy = source.to(torch.float32).to(torch.bfloat16)
    assert copy.grad_fn._input_metadata[0].dtype == torch.bfloat16
    assert cast_source(copy)[0] is source.grad_fn


def test_a_forward_without_backward_leaves_nothing_behind():
    import gc
    import weakref

    x = torch.randn(8, requires_grad=True)
    with lean_saved_tensors():
        out = (x * 1).exp()  # exp saves its own output
    ref = weakref.ref(out)
    del out
    gc.collect()
    assert ref() is None


def test_an_in_place_write_after_saving_is_refused():
    x = torch.randn(8, requires_grad=True)
    with lean_saved_tensors():
        hidden = x * 1
        out = hidden.exp()
    out.mul_(2)  # exp's saved output changed
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_a_parameterised_activation_keeps_the_plain_product():
    from trl_turbo.ops.gated_product import can_run_gated

    assert can_run_gated(torch.nn.SiLU()) and can_run_gated(torch.nn.functional.silu)
    assert not can_run_gated(torch.nn.PReLU())
