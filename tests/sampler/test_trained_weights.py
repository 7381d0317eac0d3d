"""Full fine-tuning with shared weights, one process: each parameter becomes a view of its vLLM region where the
dtypes match (the optimizer then writes what vLLM samples), else it is cast there at each sync."""

from __future__ import annotations

import pytest
import torch

from trl_turbo.vllm.trained_weights import share_trained_weights
from trl_turbo.vllm.weight_views import LayoutMismatch


def _params(dtype):
    torch.manual_seed(0)
    return [("q", torch.nn.Parameter(torch.randn(4, 3, dtype=dtype))),
            ("norm", torch.nn.Parameter(torch.randn(3, dtype=dtype)))]


def test_same_dtype_parameters_become_the_engine_regions():
    params = _params(torch.float32)
    engine = torch.zeros(6, 3)  # q is rows [2, 6) of a packed tensor, as vLLM's q|k|v
    norm = torch.zeros(3)
    engine[2:].copy_(params[0][1].detach())
    norm.copy_(params[1][1].detach())
    copies = share_trained_weights(params, {"q": engine[2:], "norm": norm})
    assert copies.casts == [] and copies.shared_bytes == (12 + 3) * 4
    with torch.no_grad():
        params[0][1].add_(1.0)  # the optimizer's in-place update
    assert torch.equal(engine[2:], params[0][1].detach()) and engine[:2].eq(0).all()
    assert copies.sync() >= 0  # nothing to copy


def test_fp32_masters_are_cast_into_a_bf16_engine_at_each_sync():
    params = _params(torch.float32)
    regions = {name: param.detach().to(torch.bfloat16).clone() for name, param in params}
    copies = share_trained_weights(params, regions)
    assert len(copies.casts) == 2 and copies.shared_bytes == 0 and copies.cast_bytes == (12 + 3) * 2
    with torch.no_grad():
        for _, param in params:
            param.mul_(3.0)
    copies.sync()
    for name, param in params:
        assert torch.equal(regions[name], param.detach().to(torch.bfloat16))


def test_a_region_that_does_not_hold_the_parameter_is_refused():
    params = _params(torch.float32)
    regions = {name: param.detach().clone() for name, param in params}
    regions["q"][0, 0] += 1
    with pytest.raises(LayoutMismatch, match="q: vLLM's region differs"):
        share_trained_weights(params, regions)
    with pytest.raises(LayoutMismatch, match="not the parameter's"):
        share_trained_weights(params, {"q": torch.zeros(3, 4), "norm": regions["norm"]})


def _train_step(model):
    ids = torch.randint(3, 20, (2, 12), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(ids, labels=ids).loss.backward()
    optimizer.step()


def test_a_full_finetuning_engine_holds_the_trained_parameters(monkeypatch):
    """Through the engine glue, on vLLM's layout (stand-in): a bf16 model's parameters become views of vLLM's
    tensors (the optimizer step lands there); fp32 masters next to a bf16 engine are cast in at each sync."""
    import copy

    from helpers import StandInVllmModel

    from trl_turbo.testing.models import tiny_model
    from trl_turbo.testing.tokenizer import VOCAB
    from trl_turbo.vllm import engine as vllm_engine

    model = tiny_model("llama", vocab_size=len(VOCAB), dtype=torch.bfloat16)
    stand_in = StandInVllmModel(model)
    monkeypatch.setattr(vllm_engine, "driver_model", lambda llm: stand_in)
    copies = vllm_engine.share_trained_parameters(object(), model)
    storages = {p.untyped_storage().data_ptr() for _, p in stand_in.named_parameters()}
    assert copies.casts == [] and all(p.untyped_storage().data_ptr() in storages for p in model.parameters())
    _train_step(model)
    qkv = stand_in.param("model.layers.0.self_attn.qkv_proj.base_layer.weight")
    q = model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(qkv[: q.shape[0]], q.detach())  # the update is vLLM's weight now

    masters = tiny_model("llama", vocab_size=len(VOCAB), dtype=torch.float32)
    stand_in = StandInVllmModel(copy.deepcopy(masters).to(torch.bfloat16))
    monkeypatch.setattr(vllm_engine, "driver_model", lambda llm: stand_in)
    copies = vllm_engine.share_trained_parameters(object(), masters)
    assert copies.shared_bytes == 0 and len(copies.casts) == len(list(masters.parameters()))
    _train_step(masters)
    copies.sync()
    qkv = stand_in.param("model.layers.0.self_attn.qkv_proj.base_layer.weight")
    q = masters.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(qkv[: q.shape[0]], q.detach().to(torch.bfloat16))
