"""Offloaded checkpointing and tiled MLPs: exact gradients, bookkeeping, no leaks across TRL's re-enables."""

from __future__ import annotations

import copy
import gc
import importlib.util
import itertools

import pytest
import torch
from helpers import checkpointed_grads, decoder_model, token_batch

import trl_turbo
from trl_turbo import registry
from trl_turbo.offload import CheckpointOffloader, TiledMLPForward
from trl_turbo.offload.install import CheckpointingRuntime, install_runtime, install_tiled_mlp, runtime_of
from trl_turbo.testing import parity
from trl_turbo.testing.models import tiny_model
from trl_turbo.testing.tokenizer import VOCAB
from trl_turbo.testing.tolerance import assert_within_naive_error

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def _fresh_patch_state():
    yield
    trl_turbo.unpatch()
    trl_turbo.patch()


@pytest.mark.parametrize("chunk_bytes", [1 << 24, 1 << 12], ids=["one-chunk", "partial-last-chunk"])
def test_offloaded_checkpoint_gradients_are_bitwise_those_of_plain_checkpointing(chunk_bytes):
    ids = token_batch()  # a layer input is 2 x 24 x 32 fp32 = 6144 bytes: 1.5 chunks of 4 KiB
    stock_loss, stock = checkpointed_grads(decoder_model(), ids)
    offloader = CheckpointOffloader(host_budget_bytes=1 << 40, min_bytes=0, chunk_bytes=chunk_bytes)
    turbo_loss, turbo = checkpointed_grads(decoder_model(), ids, runtime=CheckpointingRuntime(offloader))
    assert torch.equal(stock_loss, turbo_loss)
    assert stock.keys() == turbo.keys()
    for name in stock:
        assert torch.equal(stock[name], turbo[name]), name
    stats = offloader.take_stats()
    layer_input_bytes = ids.numel() * 32 * 4  # hidden 32, fp32
    assert stats.offloaded_bytes == 3 * layer_input_bytes  # 4 layers: the newest input never leaves the device
    assert stats.blocking_fetches == 0  # every offloaded input was prefetched one layer ahead


def test_host_budget_keeps_checkpoints_on_device():
    offloader = CheckpointOffloader(host_budget_bytes=0, min_bytes=0)
    checkpointed_grads(decoder_model(), token_batch(), runtime=CheckpointingRuntime(offloader))
    stats = offloader.take_stats()
    assert stats.offloaded_bytes == 0 and stats.kept_on_device_bytes > 0


def test_host_buffers_are_recycled_across_steps():
    offloader = CheckpointOffloader(host_budget_bytes=1 << 40, min_bytes=0)
    model = decoder_model()
    runtime = CheckpointingRuntime(offloader)
    checkpointed_grads(model, token_batch(), runtime=runtime)
    allocated = offloader.pool.allocated_bytes
    assert allocated > 0 and offloader.pool.free_bytes == allocated  # every chunk back in the pool after backward
    for seed in range(3):
        checkpointed_grads(model, token_batch(seed=seed), runtime=runtime)
        assert offloader.pool.allocated_bytes == allocated  # reused, not re-allocated


def test_pool_refuses_beyond_its_budget_and_recycles_chunks_for_any_size():
    from trl_turbo.offload.pinned_pool import PinnedPool

    pool = PinnedPool(budget_bytes=4096, chunk_bytes=1024, pin=False)
    a = pool.acquire(2500)  # 3 chunks
    assert len(a.chunks) == 3 and pool.allocated_bytes == 3072
    assert pool.acquire(1500) is None  # 2 more chunks would pass the budget while `a` is in use
    assert [(offset, piece.numel()) for offset, piece in a.pieces()] == [(0, 1024), (1024, 1024), (2048, 452)]
    pool.release(a)
    b = pool.acquire(4000)  # a's 3 chunks + 1 new one
    assert len(b.chunks) == 4 and pool.allocated_bytes == 4096 and pool.free_bytes == 0
    pool.release(b)
    c, d = pool.acquire(100), pool.acquire(3000)  # sizes unlike any before: served from the same chunks
    assert c is not None and d is not None and pool.allocated_bytes == 4096
    pool.release(c)
    pool.release(d)
    pool.close()
    assert pool.allocated_bytes == 0 and pool.free_bytes == 0


def test_pool_chunks_are_powers_of_two():
    from trl_turbo.offload.pinned_pool import PinnedPool

    with pytest.raises(ValueError, match="power of two"):
        PinnedPool(budget_bytes=1 << 30, chunk_bytes=3 << 20)


def test_forward_without_backward_returns_its_buffers():
    offloader = CheckpointOffloader(host_budget_bytes=1 << 40, min_bytes=0)
    model = decoder_model()
    model.gradient_checkpointing_enable()
    install_runtime(model, CheckpointingRuntime(offloader))
    loss = model(token_batch(), labels=token_batch()).loss
    assert offloader.pool.free_bytes == 0 and offloader.pool.allocated_bytes > 0
    del loss
    gc.collect()
    assert offloader.pool.free_bytes == offloader.pool.allocated_bytes


def test_inert_without_grad():
    offloader = CheckpointOffloader(host_budget_bytes=1 << 40, min_bytes=0)
    model = decoder_model()
    model.gradient_checkpointing_enable()
    install_runtime(model, CheckpointingRuntime(offloader))
    with torch.no_grad():
        model(token_batch())
    with torch.inference_mode():
        model(token_batch())
    assert offloader.take_stats().offloaded_bytes == 0
    assert offloader._newest is None


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
@pytest.mark.parametrize("checkpointing", [True, False])
def test_tiled_mlp_matches_plain_mlp(arch, checkpointing):
    ids = token_batch(batch=2, length=24)
    stock_loss, stock = checkpointed_grads(decoder_model(arch), ids, checkpointing=checkpointing)
    runtime = CheckpointingRuntime(None) if checkpointing else None
    turbo_loss, turbo = checkpointed_grads(decoder_model(arch), ids, runtime=runtime, tiled_tokens=7,
                                           checkpointing=checkpointing)
    torch.testing.assert_close(turbo_loss, stock_loss, rtol=1e-6, atol=1e-7)
    for name in stock:
        torch.testing.assert_close(turbo[name], stock[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def _lora_with_dropout(dropout: float):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)  # LoRA's A matrices are drawn from the global generator
    model = get_peft_model(decoder_model(layers=2), LoraConfig(r=4, lora_dropout=dropout,
                                                        target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1, generator=torch.Generator().manual_seed(1))
    model.train()
    return model


def _seeded_grads(model, ids, **features):
    base = model.get_base_model()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if features.get("runtime"):
        install_runtime(base, CheckpointingRuntime(None))
    if features.get("tiled_tokens"):
        install_tiled_mlp(base, features["tiled_tokens"])
    torch.manual_seed(123)  # the dropout masks
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_lora_dropout_gradients_equal_plain_checkpointing():
    """Dropout masks drawn in the forward must be the ones the backward uses: the checkpoint recompute replays the
    random state; an MLP with active dropout runs untiled (its tiles' recompute would draw new masks)."""
    ids = token_batch(batch=2, length=24)
    stock_loss, stock = _seeded_grads(_lora_with_dropout(0.5), ids)
    turbo_loss, turbo = _seeded_grads(_lora_with_dropout(0.5), ids, runtime=True, tiled_tokens=8)
    torch.testing.assert_close(turbo_loss, stock_loss, rtol=0, atol=0)
    assert stock.keys() == turbo.keys() and stock
    for name in stock:
        torch.testing.assert_close(turbo[name], stock[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    mlp = _lora_with_dropout(0.0).get_base_model()
    install_tiled_mlp(mlp, 8)
    out = mlp.model.layers[0].mlp(torch.randn(1, 20, 32, requires_grad=True))
    assert "TiledMLP" in type(out.grad_fn).__name__  # without dropout the same MLP is tiled


def test_keyword_tensors_that_need_gradients_get_them():
    """transformers binds a layer's keyword arguments with functools.partial; the checkpoint function must not
    detach a keyword tensor that requires grad (it hands such calls to PyTorch's non-reentrant checkpoint)."""
    import functools

    from torch.utils.checkpoint import checkpoint

    from trl_turbo.offload import offloaded_checkpoint

    linear = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    scale = torch.randn(4, requires_grad=True)
    results = []
    for function in (functools.partial(checkpoint, use_reentrant=False), offloaded_checkpoint(None, linear)):
        linear.zero_grad()
        x.grad = scale.grad = None
        out = function(functools.partial(lambda h, scale: linear(h) * scale, scale=scale), x)
        out.sum().backward()
        results.append((x.grad.clone(), scale.grad.clone(), linear.weight.grad.clone()))
    for stock, turbo in zip(*results):
        torch.testing.assert_close(turbo, stock, rtol=0, atol=0)


def test_layers_outside_the_tested_families_keep_transformers_checkpointing():
    """MoE layers (router logits captured by hooks feed the aux loss) and other families keep their own
    checkpoint function and plain MLP."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from trl_turbo.families import DECODER_LAYER_CLASSES

    model = tiny_model("llama", vocab_size=len(VOCAB), layers=2)

    moe = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen3_moe", vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01))
    moe.train()
    assert type(moe.model.layers[0]).__name__ not in DECODER_LAYER_CLASSES
    moe.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    before = moe.model.layers[0]._gradient_checkpointing_func
    install_runtime(moe, CheckpointingRuntime(None))
    assert install_tiled_mlp(moe, 8) == 0
    assert moe.model.layers[0]._gradient_checkpointing_func is before
    ids = token_batch(batch=2, length=24)
    out = moe(ids, labels=ids)
    assert out.aux_loss.requires_grad  # the router is still trained by its balancing loss
    assert install_tiled_mlp(model, 8) == 2  # the llama layers are


def test_a_later_trainer_on_the_same_model_gets_exactly_its_own_features(tmp_path):
    """A second trainer with every feature off leaves nothing of the first installed; after two configured trainers,
    `unpatch()` gives each layer back transformers' checkpoint function."""
    from trl import GRPOConfig, GRPOTrainer

    from trl_turbo.offload import LeanRMSNormForward
    from trl_turbo.tasks import arithmetic
    from trl_turbo.testing.tokenizer import build_tokenizer

    model = tiny_model("llama", vocab_size=len(VOCAB))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    transformers_function = model.model.layers[0]._gradient_checkpointing_func

    def trainer(**features):
        args = GRPOConfig(**parity.base_config_kwargs(str(tmp_path), gradient_checkpointing=True, **features))
        return GRPOTrainer(model=model, reward_funcs=[arithmetic.format_reward], args=args,
                           processing_class=build_tokenizer(), train_dataset=arithmetic.load_dataset("train").select(
                               range(8)))

    def installed():
        layer = model.model.layers[0]
        return (hasattr(layer._gradient_checkpointing_func, "__trl_turbo_offloader__"),
                isinstance(layer.mlp.__dict__.get("forward"), TiledMLPForward),
                isinstance(layer.input_layernorm.__dict__.get("forward"), LeanRMSNormForward))

    trainer(turbo_tiled_mlp_tokens=4)
    assert installed() == (True, True, True)
    trainer(**parity.ALL_FEATURES_OFF)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # as train() does
    assert installed() == (False, False, False)
    trainer(turbo_tiled_mlp_tokens=4)
    trainer(turbo_tiled_mlp_tokens=8)
    assert installed() == (True, True, True) and model.model.layers[0].mlp.forward.tile_tokens == 8
    trl_turbo.unpatch()
    assert installed() == (False, False, False)
    assert type(model.model.layers[0]._gradient_checkpointing_func) is type(transformers_function)


def test_tiled_mlp_leaves_small_inputs_alone():
    model = decoder_model()
    install_tiled_mlp(model, 10_000)
    forward = model.model.layers[0].mlp.forward
    assert isinstance(forward, TiledMLPForward)
    x = torch.randn(1, 5, 32, requires_grad=True)
    out = forward(x)
    assert "TiledMLP" not in type(out.grad_fn).__name__, type(out.grad_fn).__name__  # the plain MLP's graph
    torch.testing.assert_close(out, forward.original(x), rtol=0, atol=0)
    assert "TiledMLP" in type(forward(torch.randn(1, 20_000, 32, requires_grad=True)).grad_fn).__name__


def test_installation_is_idempotent_and_undone_by_unpatch():
    model = decoder_model()
    assert install_tiled_mlp(model, 8) == 4
    records = len(registry._records)
    assert install_tiled_mlp(model, 16) == 4
    assert len(registry._records) == records
    assert model.model.layers[0].mlp.forward.tile_tokens == 16
    model.gradient_checkpointing_enable()
    install_runtime(model, CheckpointingRuntime(None))
    original = registry.original(model.model.layers[0], "_gradient_checkpointing_func")
    trl_turbo.unpatch()
    layer = model.model.layers[0]
    assert "forward" not in layer.mlp.__dict__
    assert layer._gradient_checkpointing_func is original
    assert not hasattr(model, "_trl_turbo_checkpointing")


def test_repeated_enable_disable_cycles_do_not_leak_hooks_or_change_the_function():
    """TRL disables and re-enables checkpointing around every generation, with raw kwargs."""
    model = decoder_model()
    model.gradient_checkpointing_enable()
    runtime = CheckpointingRuntime(None)
    install_runtime(model, runtime)
    embed = model.get_input_embeddings()
    for _ in range(5):
        model.gradient_checkpointing_disable()
        model.gradient_checkpointing_enable({"use_reentrant": False, "offload": True, "every_n_layers": 1})
        assert all(layer._gradient_checkpointing_func is runtime.checkpoint_for(layer) for layer in model.model.layers)
        assert len(embed._forward_hooks) == 1
    loss, grads = checkpointed_grads(model, token_batch(), checkpointing=False)
    assert grads and torch.isfinite(loss)


def test_trainer_installs_runtime_and_tiles(tmp_path):
    trainer = parity.build_trainer(parity.base_config_kwargs(str(tmp_path), gradient_checkpointing=True,
                                                             turbo_tiled_mlp_tokens=4), peft=True)
    base = trainer.model.get_base_model()
    assert isinstance(runtime_of(trainer.model), CheckpointingRuntime)
    assert runtime_of(trainer.model) is base._trl_turbo_checkpointing
    assert runtime_of(trainer.model).offloader is None  # no CUDA device: nothing to offload to
    assert all(isinstance(layer.mlp.forward, TiledMLPForward) for layer in base.model.layers)


def test_training_memory_budget_is_the_plans_ceiling(tmp_path):
    trainer = parity.build_trainer(parity.base_config_kwargs(str(tmp_path), gradient_checkpointing=True,
                                                             turbo_training_memory_gib=7.5), peft=True)
    assert runtime_of(trainer.model).planner.ceiling() == int(7.5 * 2**30)
    default = parity.build_trainer(parity.base_config_kwargs(str(tmp_path), gradient_checkpointing=True), peft=True)
    assert runtime_of(default.model).planner.ceiling is None  # no vLLM engine: the whole device


def test_trainer_switches_off_install_nothing(tmp_path):
    trainer = parity.build_trainer(parity.base_config_kwargs(
        str(tmp_path), gradient_checkpointing=True, turbo_memory_plan="min", turbo_offload_checkpoints=False,
        turbo_tiled_mlp=False))
    assert runtime_of(trainer.model) is None
    assert not any("forward" in layer.mlp.__dict__ for layer in trainer.model.model.layers)


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_training_with_checkpointing_and_tiles_matches_stock(peft):
    overrides = {"gradient_checkpointing": True, "max_completion_length": 8}
    stock = parity.run_training("stock", overrides, steps=2, peft=peft, model_kwargs={"tie_word_embeddings": False})
    turbo = parity.run_training("turbo", {**overrides, "turbo_tiled_mlp_tokens": 5, "turbo_memory_plan": "min"},
                                steps=2, peft=peft,
                                model_kwargs={"tie_word_embeddings": False})
    parity.assert_records_close(stock, turbo, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------------------ GPU
def _gpu_model(dtype, peft):
    model = decoder_model(layers=6, device="cuda", dtype=dtype)
    if peft:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)  # LoRA A is drawn from the global generator: the same adapter in every model built here
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
        model.enable_input_require_grads()
    return model


def _gpu_grads(model, ids, offloader, peft):
    base = model.get_base_model() if peft else model
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    install_runtime(base, CheckpointingRuntime(offloader))
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class _SlowCopies(CheckpointOffloader):
    """Queues ~50 ms of sleep on the device-to-host stream before every copy out: a copy back that does not wait for
    it, a consumer that does not wait for its copy, or memory freed/reused while a copy still reads it then shows up
    as corrupted gradients."""

    def _side_streams(self, device):
        d2h, h2d = super()._side_streams(device)
        with torch.cuda.stream(d2h):
            torch.cuda._sleep(50_000_000)
        return d2h, h2d


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize(("offloader_cls", "chunk_bytes"), [(CheckpointOffloader, 1 << 24), (_SlowCopies, 1 << 24),
                                                         (_SlowCopies, 1 << 12)],
                         ids=["streams", "slow-copies", "slow-copies-16-chunks"])
def test_gpu_offload_gradients_bitwise_equal(dtype, peft, offloader_cls, chunk_bytes):
    """Offload on vs off (same checkpoint function, inputs kept on the device): bitwise equal gradients. A layer
    input is 4 x 255 x 32 x 2 bytes: 16 chunks of 4 KiB, the last one partial."""
    ids = token_batch(batch=4, length=255).cuda()
    on_device = _gpu_grads(_gpu_model(dtype, peft), ids, None, peft)
    again = _gpu_grads(_gpu_model(dtype, peft), ids, None, peft)
    for name in on_device:  # without this, a nondeterministic kernel would read as an offload bug
        assert torch.equal(on_device[name], again[name]), f"the baseline itself is not deterministic: {name}"
    offloader = offloader_cls(host_budget_bytes=1 << 40, min_bytes=0, chunk_bytes=chunk_bytes)
    offloaded = _gpu_grads(_gpu_model(dtype, peft), ids, offloader, peft)
    assert on_device.keys() == offloaded.keys() and on_device
    for name in on_device:
        assert torch.equal(on_device[name], offloaded[name]), name
    stats = offloader.take_stats()
    assert stats.offloaded_bytes > 0 and stats.blocking_fetches == 0


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_gpu_offloaded_checkpoint_matches_torch_checkpoint(peft):
    """Against torch.utils.checkpoint (non-reentrant), only the summation order of gradients may differ."""
    ids = token_batch(batch=4, length=256).cuda()
    model = _gpu_model(torch.float32, peft)
    base = model.get_base_model() if peft else model
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model(ids, labels=ids).loss.backward()
    stock = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    offloader = CheckpointOffloader(host_budget_bytes=1 << 40, min_bytes=0)
    turbo = _gpu_grads(_gpu_model(torch.float32, peft), ids, offloader, peft)
    for name in stock:
        torch.testing.assert_close(turbo[name], stock[name], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------- lean norms
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_norm_matches_the_original_norm(arch, dtype):
    from trl_turbo.offload.install import install_lean_norms

    model = decoder_model(arch, layers=1, dtype=dtype)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms
    gen = torch.Generator().manual_seed(0)
    width = norms[0].weight.shape[0]
    x = torch.randn(3, 5, width, generator=gen).to(dtype).requires_grad_(True)
    with torch.no_grad():
        norms[0].weight.copy_(torch.rand(width, generator=gen) + 0.5)

    def grads(norm, inputs):
        out = norm(inputs)
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
        result = out.detach(), inputs.grad.clone(), norm.weight.grad.clone()
        inputs.grad = norm.weight.grad = None
        return result

    exact = grads(copy.deepcopy(norms[0]).double(), x.detach().double().requires_grad_(True))
    stock = grads(norms[0], x)
    assert install_lean_norms(model) == len(norms)
    lean = grads(norms[0], x)
    assert torch.equal(lean[0], stock[0])  # the same forward operations
    for what, lean_value, stock_value, exact_value in zip(("x grad", "weight grad"), lean[1:], stock[1:], exact[1:]):
        if dtype == torch.float32:
            torch.testing.assert_close(lean_value, stock_value, rtol=1e-5, atol=1e-6)
        else:
            assert_within_naive_error(lean_value, stock_value, exact_value, what=what)


def test_lean_norms_skip_other_norm_formulas():
    from trl_turbo.offload.install import install_lean_norms

    assert install_lean_norms(decoder_model("gemma")) == 0  # gemma scales by (1 + weight): left alone


@pytest.mark.gpu
@requires_cuda
def test_gpu_200_grpo_steps_keep_device_and_host_memory_flat(tmp_path):
    """200 real GRPO steps (generation, rewards, offloaded/tiled/grouped training) on a small model: after warm-up,
    device memory at step end and the pinned pool's size stay constant (no leak across TRL's GC re-enables)."""
    from transformers import TrainerCallback

    config = parity.base_config_kwargs(
        str(tmp_path), use_cpu=False, bf16=True, gradient_checkpointing=True, max_steps=200,
        per_device_train_batch_size=8, num_generations=8, max_completion_length=64, turbo_tiled_mlp_tokens=128,
        turbo_forward_token_budget=256, turbo_offload_host_budget_gib=4.0,
        turbo_memory_plan="min",  # every layer offloads: "auto" would keep this small model's activations
    )
    trainer = parity.build_trainer(config, peft=True, model_kwargs={"tie_word_embeddings": False,
                                                                    "hidden_size": 256, "layers": 4})
    offloader = runtime_of(trainer.model).offloader
    offloader.min_bytes = 0  # this model's activations are far below the production threshold
    device, host = [], []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            device.append(torch.cuda.memory_allocated())
            host.append(offloader.pool.allocated_bytes)

    trainer.add_callback(Record())
    trainer.train()
    assert len(device) == 200
    assert max(device[20:]) - min(device[20:]) <= 1 << 20, "device memory grows across steps"
    # Completion lengths vary, so the pool may grow when a step needs more than any before it; a leak instead
    # grows it step after step (every checkpoint not handed back is a new buffer) until the budget refuses.
    growth_steps = sum(later > earlier for earlier, later in itertools.pairwise(host[20:]))
    assert host[-1] > 0 and growth_steps <= 5 and host[-1] <= 2 * host[20], f"pinned host memory grows: {host}"
    kept = [log["offload/kept_on_device_gib"] for log in trainer.state.log_history
            if "offload/kept_on_device_gib" in log]
    assert len(kept) >= 100 and max(kept) == 0, "checkpoints stayed on the device: the pool ran out of budget"
    embed = trainer.model.get_base_model().get_input_embeddings()
    assert len(embed._forward_hooks) == 1


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel")
def test_liger_layers_install_under_tiles_and_undo():
    # Only the wiring runs on CPU (Liger's kernels need CUDA; tests/ops/test_liger_layers.py runs them on the GPU)
    import trl_turbo
    from trl_turbo.offload.install import install_lean_norms, install_liger_layers, install_tiled_mlp
    from trl_turbo.ops.liger_layers import LigerRMSNormForward, LigerSwiGLUForward

    model = tiny_model("llama", vocab_size=len(VOCAB), layers=2)
    install_lean_norms(model)  # an earlier trainer's choice: Liger's norms replace them
    assert install_liger_layers(model) == 2 * 2 + 1 + 2
    install_tiled_mlp(model, 8)
    for layer in model.model.layers:
        assert isinstance(layer.input_layernorm.forward, LigerRMSNormForward)
        assert isinstance(layer.mlp.forward, TiledMLPForward) and isinstance(layer.mlp.forward.original,
                                                                             LigerSwiGLUForward)
    install_liger_layers(model)  # idempotent
    trl_turbo.unpatch()
    try:
        for layer in model.model.layers:
            assert "forward" not in layer.mlp.__dict__ and "forward" not in layer.input_layernorm.__dict__
    finally:
        trl_turbo.patch()


def _mlp_tokens_per_step(model, ids, runtime):
    passes = []
    for layer in model.model.layers:
        forward = layer.mlp.forward
        real = forward.original

        def counting(x, real=real):
            passes.append(x.numel() // x.shape[-1])
            return real(x)

        forward.original = counting
    loss, grads = checkpointed_grads(model, ids, runtime=runtime, checkpointing=True)
    return sum(passes) / (ids.numel() * len(model.model.layers)), loss, grads


@pytest.mark.parametrize("free_tokens", [None, 10_000, 30])
def test_under_auto_a_post_norm_mlp_runs_untiled_where_it_fits(free_tokens):
    """Gemma-2's post-feedforward norm needs the MLP's output in the recompute, so a tiled MLP runs three passes per
    token; under the "auto" plan it runs untiled (two passes, as stock) wherever its working set fits, and tiles
    where it does not."""
    ids = token_batch(batch=2, length=24)
    stock_loss, stock = checkpointed_grads(decoder_model("gemma2"), ids, checkpointing=True)
    counts = {}
    for untile in (None, False, True):  # not under "auto"; a plan that keeps no layer; one that keeps some
        model = decoder_model("gemma2")
        install_tiled_mlp(model, 7, untile_post_norm=None if untile is None else (lambda untile=untile: untile))
        for layer in model.model.layers:
            if free_tokens is not None:  # a device with room for this many tokens' working set
                forward = layer.mlp.forward
                forward.free_bytes = lambda device, f=forward: 2 * free_tokens * 8 * f.intermediate_size * 4
        counts[untile], loss, grads = _mlp_tokens_per_step(model, ids, CheckpointingRuntime(None))
        torch.testing.assert_close(loss, stock_loss, rtol=1e-6, atol=1e-7)
        for name in stock:
            torch.testing.assert_close(grads[name], stock[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert counts[None] == counts[False] == 3.0
    assert counts[True] == (2.0 if free_tokens != 30 else 3.0)  # 48 tokens do not fit a room of 30: tiled


def test_an_mlp_feeding_the_residual_stays_tiled_under_auto():
    """Llama's MLP output feeds the residual sum: its tiles cost no extra pass, so they stay whatever the plan."""
    for arch, tiled in (("llama", True), ("gemma2", False)):
        model = decoder_model(arch, layers=1)
        install_tiled_mlp(model, 7, untile_post_norm=lambda: True)
        out = model.model.layers[0].mlp(torch.randn(1, 20, model.config.hidden_size, requires_grad=True))
        assert ("TiledMLP" in type(out.grad_fn).__name__) is tiled, arch


def test_tiles_shrink_to_what_the_device_has_free():
    from trl_turbo.offload.tiled_mlp import MIN_TILE_TOKENS, fitting_tile_tokens

    per_token = 8 * 8960 * 2  # Qwen2.5-1.5B's MLP working set per token, bf16
    assert fitting_tile_tokens(16384, 8704, per_token, 100 << 30) == 16384  # a large GPU: untouched
    assert fitting_tile_tokens(16384, 8704, per_token, None) == 16384  # no device to ask
    assert fitting_tile_tokens(16384, 8704, per_token, int(0.6 * 2**30)) == 2048  # the 5 GiB run's room
    assert fitting_tile_tokens(16384, 8704, per_token, 0) == MIN_TILE_TOKENS
    assert fitting_tile_tokens(128, 8704, per_token, 0) == 128  # never above what the user set


def test_a_short_device_tiles_the_mlp_finer_with_the_same_gradients():
    ids = token_batch(batch=2, length=400)  # 800 tokens, untiled at the configured 10,000
    stock_loss, stock = checkpointed_grads(decoder_model(), ids, checkpointing=True)
    model = decoder_model()
    install_tiled_mlp(model, 10_000)
    tiles = []
    for layer in model.model.layers:
        forward = layer.mlp.forward
        forward.free_bytes = lambda device, f=forward: 2 * 300 * 8 * f.intermediate_size * 4  # room for ~300 tokens
        real = forward.original

        def counting(x, real=real):
            tiles.append(x.numel() // x.shape[-1])
            return real(x)

        forward.original = counting
    turbo_loss, turbo = checkpointed_grads(model, ids, runtime=CheckpointingRuntime(None), checkpointing=True)
    assert tiles and max(tiles) == 256  # a power of two within the room, never the whole 800 tokens
    torch.testing.assert_close(turbo_loss, stock_loss, rtol=1e-6, atol=1e-7)
    for name in stock:
        torch.testing.assert_close(turbo[name], stock[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_without_cuda_the_automatic_plan_says_once_that_it_keeps_everything(tmp_path, monkeypatch, caplog):
    import logging

    from trl_turbo.offload import setup

    monkeypatch.setattr(setup, "_said_without_cuda", [False])
    with caplog.at_level(logging.INFO, logger="trl_turbo"):
        for _ in range(2):
            parity.build_trainer(parity.base_config_kwargs(str(tmp_path), gradient_checkpointing=True), peft=True)
    said = [r.getMessage() for r in caplog.records if "no CUDA device" in r.getMessage()]
    assert len(said) == 1 and "keeps every layer's activations" in said[0]
    monkeypatch.setattr(setup, "_said_without_cuda", [False])
    assert setup.say_what_auto_means_without_cuda(object(), torch.device("cuda")) is None
