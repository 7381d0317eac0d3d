"""`import trl_turbo` patches TRL at seams, idempotently, and `unpatch()` restores every original object."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import trl.trainer.utils as trl_utils
from helpers import needs_bnb, quantized_peft_model, token_batch
from trl import GRPOConfig, GRPOTrainer

import trl_turbo
from trl_turbo import registry, versions

PATCHED_METHODS = ("_compute_loss", "_get_per_token_logps_and_entropies", "_generate_and_score_completions")


def _snapshot() -> dict[str, object]:
    snap = {name: GRPOTrainer.__dict__[name] for name in PATCHED_METHODS}
    snap["kernel"] = trl_utils._ChunkedLogProbFunction
    for attr in ("__init__", "__repr__", "__eq__", "__post_init__", "__dataclass_fields__", "__annotations__"):
        snap[f"config.{attr}"] = GRPOConfig.__dict__[attr]
    return snap


@pytest.fixture
def restore_patch_state():
    yield
    trl_turbo.patch()


def test_import_patches_trl():
    assert trl_turbo.is_patched()
    assert trl_utils._ChunkedLogProbFunction.__module__.startswith("trl_turbo")
    assert "turbo_fused_loss" in GRPOConfig.__dataclass_fields__


def test_unpatch_restores_every_original_object(restore_patch_state):
    patched = _snapshot()
    trl_turbo.unpatch()
    assert not trl_turbo.is_patched()
    stock = _snapshot()
    from trl.kernels import ChunkedLogProbFunction

    assert stock["kernel"] is ChunkedLogProbFunction
    for key in stock:
        assert stock[key] is not patched[key], f"{key} was not restored"
    assert not any(name.startswith("turbo_") for name in GRPOConfig.__dataclass_fields__)
    assert not hasattr(GRPOConfig, "turbo_fused_loss")
    with pytest.raises(TypeError, match="turbo_fused_loss"):
        GRPOConfig(output_dir="unused", turbo_fused_loss=True)
    trl_turbo.patch()
    repatched = _snapshot()
    assert repatched["kernel"] is patched["kernel"]
    assert "turbo_fused_loss" in GRPOConfig.__dataclass_fields__


# Run in a fresh interpreter: every attribute of every loaded trl/transformers/peft/accelerate module and of the
# classes they define is recorded before `import trl_turbo`, so "restored" is checked against the objects that were
# there before any patch, not against trl_turbo's own record of them.
ROUND_TRIP_SCRIPT = """
import json, sys
import accelerate, peft, transformers, trl, trl.trainer.grpo_trainer, trl.trainer.utils
import trl.generation.vllm_generation

HOSTS = ("trl", "transformers", "peft", "accelerate")


def owners():
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] not in HOSTS:
            continue
        yield name, module
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and getattr(value, "__module__", None) == name:
                yield name + "." + attr, value


before = {key: (owner, dict(vars(owner))) for key, owner in owners()}


def changes():
    replaced, removed, added = [], [], []
    for key, (owner, old) in before.items():
        new = vars(owner)
        replaced += [key + "." + a for a, v in old.items() if a in new and new[a] is not v]
        removed += [key + "." + a for a in old if a not in new]
        added += [key + "." + a for a in new.keys() - old.keys()]
    return {"replaced": sorted(replaced), "removed": sorted(removed), "added": sorted(added)}


import trl_turbo

result = {"patched": changes()}
trl_turbo.unpatch()
result["unpatched"] = changes()
trl_turbo.patch()
result["repatched"] = changes()
trl_turbo.unpatch()
result["unpatched_again"] = changes()
print("RESULT " + json.dumps(result))
"""


def test_unpatch_restores_every_attribute_it_changed(tmp_path):
    import json
    import subprocess
    import sys

    script = tmp_path / "round_trip.py"
    script.write_text(ROUND_TRIP_SCRIPT)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    changes = json.loads(line[len("RESULT "):])
    patched = changes["patched"]
    # The probe sees the patches: methods of GRPOTrainer and GRPOConfig's dataclass machinery replaced, fields added
    assert "trl.trainer.grpo_trainer.GRPOTrainer._compute_loss" in patched["replaced"]
    assert "trl.trainer.grpo_config.GRPOConfig.__dataclass_fields__" in patched["replaced"]
    assert "trl.trainer.grpo_config.GRPOConfig.turbo_fused_loss" in patched["added"]
    assert not patched["removed"]
    nothing = {"replaced": [], "removed": [], "added": []}
    assert changes["unpatched"] == nothing
    assert changes["repatched"] == patched
    assert changes["unpatched_again"] == nothing


def test_patch_is_idempotent():
    before = _snapshot()
    records = len(registry._records)
    assert trl_turbo.patch()
    assert trl_turbo.patch()
    assert len(registry._records) == records
    assert _snapshot() == before


def test_unpatch_twice_is_harmless(restore_patch_state):
    trl_turbo.unpatch()
    trl_turbo.unpatch()
    assert not trl_turbo.is_patched()


def test_unsupported_versions_warn_once_and_leave_trl_stock(restore_patch_state):
    import trl_turbo.patches as patches

    trl_turbo.unpatch()
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings(record=True) as caught:
        mp.setitem(versions.SUPPORTED, "trl", ("0.1.0", "0.2.0"))
        mp.setattr(patches, "_warned", False)
        warnings.simplefilter("always")
        assert trl_turbo.patch() is False
        assert trl_turbo.patch() is False
        assert not trl_turbo.is_patched()
        from trl.kernels import ChunkedLogProbFunction

        assert trl_utils._ChunkedLogProbFunction is ChunkedLogProbFunction
    messages = [str(w.message) for w in caught if "trl_turbo is inactive" in str(w.message)]
    assert len(messages) == 1
    assert "trl==" in messages[0] and ">=0.1.0,<0.2.0" in messages[0]


def test_version_ranges_accept_local_build_tags():
    assert versions._in_range("2.11.0+cu130", ("2.8.0", "3.0.0"))
    assert not versions._in_range("1.17.0", ("1.16.0", "1.17.0"))
    assert versions._in_range("1.16.2", ("1.16.0", "1.17.0"))


def test_registry_refuses_conflicting_double_patch():
    class Owner:
        attr = 1

    registry.set_attr(Owner, "attr", 2)
    try:
        with pytest.raises(RuntimeError, match="already patched"):
            registry.set_attr(Owner, "attr", 3)
        assert registry.original(Owner, "attr") == 1
    finally:
        # Remove only this test's record, leaving trl_turbo's own patches in place.
        record = next(r for r in registry._records if r.owner is Owner)
        registry._records.remove(record)
        Owner.attr = 1


def test_scoped_patches_nest_are_listed_and_restore_on_every_way_out():
    import types

    owner = types.SimpleNamespace(name="original")
    with registry.scoped(owner, "name", "outer"):
        assert (owner, "name", "outer") in registry.active_patches()
        with pytest.raises(KeyboardInterrupt):
            with registry.scoped(owner, "name", "inner"):
                assert owner.name == "inner"
                raise KeyboardInterrupt
        assert owner.name == "outer"
        with registry.scoped(owner, "added", 1):
            assert owner.added == 1
        assert not hasattr(owner, "added")
    assert owner.name == "original"
    assert all(patch[0] is not owner for patch in registry.active_patches())


def test_every_permanent_patch_is_listed_and_on_a_host_library():
    patches = registry.active_patches()
    assert patches, "import trl_turbo patches nothing?"
    for owner, name, value in patches:
        module = getattr(owner, "__module__", None) or getattr(owner, "__name__", "")
        assert module.split(".")[0] in ("trl", "transformers", "peft", "vllm", "torch", "accelerate"), (owner, name)
        assert getattr(owner, name) is value, (owner, name)


def test_scoped_patches_with_values_that_do_not_compare_restore_in_order():
    import types

    import torch

    owner = types.SimpleNamespace(weight=torch.zeros(2))
    original = owner.weight
    with registry.scoped(owner, "weight", torch.ones(2)):
        with registry.scoped(owner, "weight", torch.full((2,), 2.0)):
            assert owner.weight[0] == 2
        assert owner.weight[0] == 1
    assert owner.weight is original
    assert all(patch[0] is not owner for patch in registry.active_patches())


# ------------------------------------------------------------------------------ patches on a model's instances
def _instance_attributes(model) -> dict[tuple[str, str], object]:
    """(module name, attribute) -> the object each module of `model` holds itself (its `__dict__`)."""
    return {(name, attr): value for name, module in model.named_modules() for attr, value in vars(module).items()}


def _class_attributes(model) -> dict[tuple[str, str], object]:
    """(class, attribute) -> the object every class of `model`'s modules (and their bases) holds itself."""
    classes = {cls for module in model.modules() for cls in type(module).__mro__}
    return {(f"{cls.__module__}.{cls.__qualname__}", attr): value
            for cls in classes for attr, value in vars(cls).items()}


def _differences(before: dict, after: dict) -> list[str]:
    """The keys whose object is not the same (or that only one side has)."""
    return sorted(str(key) for key in before.keys() | after.keys()
                  if before.get(key, before) is not after.get(key, after))


def _unlisted_instance_changes(model, before: dict) -> list[str]:
    """The instance attributes of `model`'s modules that differ from `before` without a registry patch in force that
    set them to what they hold now."""
    modules = dict(model.named_modules())
    listed = {(id(owner), name) for owner, name, value in registry.active_patches() if getattr(owner, name) is value}
    now = _instance_attributes(model)
    changed = [key for key in before.keys() | now.keys() if before.get(key, before) is not now.get(key, now)]
    return sorted(f"{module or '<model>'}.{attr}" for module, attr in changed
                  if (id(modules[module]), attr) not in listed)


@needs_bnb
def test_every_change_to_a_model_is_a_listed_registry_patch_and_unpatch_restores_each_object(tmp_path,
                                                                                              restore_patch_state):
    """A tiny NF4 Llama with LoRA, checkpointed through trl_turbo's runtime with tiled MLPs (whose 4-bit weights are
    dequantized once per tile loop) and lean norms: every attribute of every module that differs from the stock
    model, after installation and inside a dequantize-once scope of a training pass, is a registry patch in force;
    after the pass only the permanent ones remain, and `unpatch()` puts every module's and every class's original
    objects back and leaves no patch listed."""
    from trl_turbo.offload.install import CheckpointingRuntime, install_lean_norms, install_runtime, install_tiled_mlp
    from trl_turbo.offload.lean_norm import LeanRMSNormForward
    from trl_turbo.offload.tiled_mlp import TiledMLPForward
    from trl_turbo.ops.dequantized_linear import OnceDequantizedForward, is_4bit_linear

    peft_model = quantized_peft_model(tmp_path, bnb_4bit_quant_type="nf4", load_in_4bit=True)
    model = peft_model.get_base_model()
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = token_batch(length=12)

    def train_pass():
        peft_model.zero_grad(set_to_none=True)
        peft_model(input_ids=ids, labels=ids).loss.backward()

    train_pass()  # bitsandbytes settles each layer's compute type at its first call
    trl_turbo.unpatch()
    stock_classes = _class_attributes(model)
    assert trl_turbo.patch()
    stock = _instance_attributes(model)

    runtime = CheckpointingRuntime(None)
    install_runtime(model, runtime)
    assert install_lean_norms(model) and install_tiled_mlp(model, tile_tokens=4)
    layers = model.model.layers
    assert model._trl_turbo_checkpointing is runtime
    assert (model, "_trl_turbo_checkpointing", runtime) in registry.active_patches()
    assert all(layer._gradient_checkpointing_func is runtime.checkpoint_for(layer) for layer in layers)
    assert all(isinstance(layer.mlp.forward, TiledMLPForward) for layer in layers)
    assert all(isinstance(layer.input_layernorm.forward, LeanRMSNormForward) for layer in layers)
    assert _unlisted_instance_changes(model, stock) == []
    installed = _instance_attributes(model)

    inside_scopes = []
    mlp_4bit = [m for m in layers[0].mlp.modules() if is_4bit_linear(m)]  # gate, up, down

    def record(module, args):
        if "forward" in vars(module):  # inside the tiled MLP's dequantize-once scope
            inside_scopes.append((_unlisted_instance_changes(model, stock), registry.scoped_patches()))

    hook = mlp_4bit[0].register_forward_pre_hook(record)
    try:
        train_pass()
    finally:
        hook.remove()
    assert inside_scopes, "no dequantize-once scope was entered"
    for unlisted, scoped in inside_scopes:
        assert unlisted == []
        assert [(owner, name) for owner, name, _ in scoped] == [(m, "forward") for m in mlp_4bit]
        assert all(isinstance(value, OnceDequantizedForward) for _, _, value in scoped)
    assert registry.scoped_patches() == []
    assert _differences(installed, _instance_attributes(model)) == []

    trl_turbo.unpatch()
    assert registry.active_patches() == []
    assert _differences(stock, _instance_attributes(model)) == []
    assert _differences(stock_classes, _class_attributes(model)) == []
    assert not hasattr(model, "_trl_turbo_checkpointing")
    train_pass()  # stock again: transformers' checkpointing, bitsandbytes' and the modeling code's forwards


@needs_bnb
def test_dequantized_once_forwards_are_scoped_registry_patches_gone_however_the_scope_ends():
    import bitsandbytes as bnb
    import torch

    from trl_turbo.ops.dequantized_linear import OnceDequantizedForward, dequantized_once

    def layer_4bit():
        layer = bnb.nn.Linear4bit(32, 16, bias=False, compute_dtype=torch.float32, quant_type="nf4")
        layer.weight = bnb.nn.Params4bit(torch.randn(16, 32) * 0.05, requires_grad=False, quant_type="nf4")
        return layer.to("cpu")

    module = torch.nn.Sequential(layer_4bit(), torch.nn.Linear(16, 16), layer_4bit())
    quantized = [module[0], module[2]]
    module(torch.randn(2, 32))
    for ending in ("normal", "exception"):
        with contextlib.suppress(KeyboardInterrupt), dequantized_once(module):
            scoped = registry.scoped_patches()
            assert [(owner, name) for owner, name, _ in scoped] == [(layer, "forward") for layer in quantized]
            assert all(isinstance(value, OnceDequantizedForward) and owner.forward is value
                       for owner, _, value in scoped)
            assert all(patch in registry.active_patches() for patch in scoped)
            with dequantized_once(module):  # nested: the outer scope's forwards stay, nothing is added
                assert registry.scoped_patches() == scoped
            assert registry.scoped_patches() == scoped
            if ending == "exception":
                raise KeyboardInterrupt
        assert registry.scoped_patches() == []
        assert not any("forward" in vars(layer) for layer in quantized), ending


# ------------------------------------------------------------------------------ scoped patches outside `patches/`
def test_the_cli_points_trls_launcher_at_trl_turbo_only_for_the_command(monkeypatch):
    import sys

    import trl.cli.accelerate_launcher as accelerate_launcher
    import trl.cli.main  # noqa: F401  (the module, which `trl.cli` shadows with its function)

    from trl_turbo import cli

    stock = accelerate_launcher.launch_training_script
    seen = []

    def trl_main(argv):
        seen.append((accelerate_launcher.launch_training_script, registry.scoped_patches()))
        if argv == ["fail"]:
            raise SystemExit(3)
        return 0

    monkeypatch.setattr(sys.modules["trl.cli.main"], "main", trl_main)
    assert cli.main(["grpo"]) == 0
    with pytest.raises(SystemExit):
        cli.main(["fail"])
    for launcher, scoped in seen:
        assert launcher is cli.launch_training_script_with_turbo
        assert (accelerate_launcher, "launch_training_script", launcher) in scoped
    assert accelerate_launcher.launch_training_script is stock
    assert registry.scoped_patches() == []


def test_the_e2e_benchmarks_timers_are_scoped_patches_on_the_generation_instance():
    import types

    from trl_turbo.bench import e2e

    class Generation:
        def generate(self):
            return "generated"

        def sync_weights(self):
            return "synced"

    generation = Generation()
    trainer = types.SimpleNamespace(vllm_generation=generation, callbacks=[])
    trainer.add_callback = trainer.callbacks.append
    with contextlib.suppress(KeyboardInterrupt), e2e._instrument(trainer, sampler=None, steps=[], on_step=None):
        assert {name for owner, name, _ in registry.scoped_patches() if owner is generation} == {
            "generate", "sync_weights"}
        raise KeyboardInterrupt
    assert trainer.callbacks
    assert registry.scoped_patches() == []
    assert vars(generation) == {}
