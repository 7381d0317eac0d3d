"""`import trl_turbo` patches TRL at seams, idempotently, and `unpatch()` restores every original object."""

from __future__ import annotations

import warnings

import pytest
import trl.trainer.utils as trl_utils
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
        assert module.split(".")[0] in ("trl", "transformers", "peft", "vllm", "torch"), (owner, name)
        assert getattr(owner, name) is value, (owner, name)
