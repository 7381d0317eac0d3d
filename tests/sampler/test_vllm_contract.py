"""The vLLM contract (`trl_turbo.vllm_contract`): the static checker on small fake vLLM trees (CI downloads
nothing), the verdict on installed versions (GPU-verified, contract-checked, broken, outside TRL's range), the
config-time behaviour it drives, and, where `scripts/fetch_vllm_sources.py` has filled its cache, the real sources."""

from __future__ import annotations

import textwrap
import warnings
from pathlib import Path

import pytest
from helpers import as_if_vllm_installed

from trl_turbo import vllm_contract
from trl_turbo.config import Settings
from trl_turbo.run_plan import rollout_check
from trl_turbo.vllm_contract import CONTRACT, CONTRACT_0_25, check_sources, generation_for, verdict

# vLLM 0.24's shape of everything the contract names, reduced to signatures and the lines the checks read.
FAKE_0_24 = {
    "lora/worker_manager.py": """
        class WorkerLoRAManager:
            def _load_adapter(self, lora_request):
                model = self._adapter_manager.model
                return self._lora_model_cls.from_local_checkpoint(weights_mapper=model.hf_to_vllm_mapper)
    """,
    "lora/lora_model.py": """
        class LoRAModel:
            @classmethod
            def from_lora_tensors(cls, lora_model_id, tensors, peft_helper, device="cuda", dtype=None,
                                  model_vocab_size=None, weights_mapper=None, skip_prefixes=None):
                pass
    """,
    "lora/peft_helper.py": """
        class PEFTHelper:
            @classmethod
            def from_dict(cls, config_dict):
                pass
            def validate_legal(self, lora_config):
                pass
    """,
    "lora/request.py": """
        class LoRARequest:
            lora_name: str
            lora_int_id: int
            lora_path: str = ""
    """,
    "device_allocator/cumem.py": """
        def create_and_map(allocation_handle):
            pass
        def unmap_and_release(allocation_handle):
            pass
        class CuMemAllocator:
            @staticmethod
            def get_instance():
                pass
            def wake_up(self, tags=None):
                for ptr, data in self.pointer_to_data.items():
                    if tags is None or data.tag in tags:
                        create_and_map(data.handle)
            def use_memory_pool(self, tag=None):
                if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
                    torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    """,
    "v1/worker/gpu_model_runner.py": """
        class GPUModelRunner:
            def post_kv_cache_wake_up(self):
                pass
    """,
    "entrypoints/llm.py": """
        class LLM:
            def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None, priority=None):
                pass
            def reset_prefix_cache(self, reset_running_requests=False):
                pass
    """,
    "model_executor/model_loader/bitsandbytes_loader.py": """
        class BitsAndBytesModelLoader:
            def _get_quantized_weights_iterator(self, model_name_or_path, revision):
                pass
    """,
    "model_executor/layers/quantization/online/fp8.py": """
        class Fp8PerTensorOnlineLinearMethod:
            pass
    """,
    "model_executor/layers/quantization/fp8.py": """
        class Fp8Config:
            def __init__(self, is_checkpoint_fp8_serialized=False):
                self.is_checkpoint_fp8_serialized = is_checkpoint_fp8_serialized
    """,
}


# vLLM 0.25's generation: the loader unstacks the mapper, allocations record their sleep state.
FAKE_0_25 = {
    **FAKE_0_24,
    "lora/worker_manager.py": FAKE_0_24["lora/worker_manager.py"].replace(
        "model.hf_to_vllm_mapper", "model.hf_to_vllm_mapper.get_unstacked_mapper()"),
    "device_allocator/cumem.py": FAKE_0_24["device_allocator/cumem.py"].replace(
        "create_and_map(data.handle)", "create_and_map(data.handle)\n                        data.is_asleep = False"),
    "device_allocator/__init__.py": """
        class AllocationData:
            handle: object
            tag: str
            is_asleep: bool = False
    """,
}


# vLLM 0.29's generation: the loader passes a rename-only mapper, the runner's KV wake-up hook is gone, and so is
# bitsandbytes.
FAKE_0_29 = {
    **{k: v for k, v in FAKE_0_25.items() if "bitsandbytes" not in k},
    "lora/worker_manager.py": FAKE_0_24["lora/worker_manager.py"].replace(
        "model.hf_to_vllm_mapper", "model.hf_to_vllm_mapper.get_rename_mapper()"),
    "v1/worker/gpu_model_runner.py": FAKE_0_24["v1/worker/gpu_model_runner.py"].replace(
        "def post_kv_cache_wake_up(self):", "def other(self):"),
}


def _tree(root: Path, files: dict[str, str]) -> Path:
    package = root / "vllm"
    for relative, text in files.items():
        path = package / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return package


def test_the_fake_0_24_tree_keeps_the_contract_and_covers_every_requirement(tmp_path):
    assert check_sources(_tree(tmp_path, FAKE_0_24)) == []
    assert {requirement.path for requirement in CONTRACT} == set(FAKE_0_24)


@pytest.mark.parametrize("path, old, new, expected", [
    # 0.25-0.28: vLLM's loader maps adapter names itself (a raw mapper would merge q/k/v into one entry)
    ("lora/worker_manager.py", "model.hf_to_vllm_mapper", "model.hf_to_vllm_mapper.get_unstacked_mapper()",
     "now uses get_unstacked_mapper"),
    # 0.25+: wake-up skips allocations not marked asleep (standby's own unmapping never marks them)
    ("device_allocator/cumem.py", "if tags is None or data.tag in tags:",
     "if data.is_asleep and (tags is None or data.tag in tags):", "now uses is_asleep"),
    # 0.29+: the runner's KV wake-up hook is gone
    ("v1/worker/gpu_model_runner.py", "def post_kv_cache_wake_up(self):", "def other(self):",
     "post_kv_cache_wake_up is missing"),
    # a parameter trl_turbo passes, renamed
    ("lora/lora_model.py", "weights_mapper=None", "mapper=None", "no longer takes weights_mapper"),
    # 0.31: online fp8 under quantization="fp8" is refused with a pointer to fp8_per_tensor
    ("model_executor/layers/quantization/fp8.py", "self.is_checkpoint_fp8_serialized = is_checkpoint_fp8_serialized",
     "raise ValueError('use --quantization fp8_per_tensor')", "now uses fp8_per_tensor"),
])
def test_each_kind_of_break_is_named(tmp_path, path, old, new, expected):
    files = dict(FAKE_0_24)
    assert old in files[path]
    files[path] = files[path].replace(old, new)
    problems = check_sources(_tree(tmp_path, files))
    assert len(problems) == 1 and expected in problems[0] and path in problems[0], problems


def test_a_removed_file_and_open_keyword_arguments(tmp_path):
    files = {k: v for k, v in FAKE_0_24.items() if "bitsandbytes" not in k}  # 0.28+: bitsandbytes removed
    files["lora/lora_model.py"] = """
        class LoRAModel:
            @classmethod
            def from_lora_tensors(cls, lora_model_id, tensors, peft_helper, **kwargs):
                pass
    """  # **kwargs still accepts every name trl_turbo passes
    problems = check_sources(_tree(tmp_path, files))
    assert problems == ["model_executor/model_loader/bitsandbytes_loader.py is missing (shared 4-bit weights: the "
                        "loader fed the training model's bytes)"]


def test_each_generation_has_its_own_contract(tmp_path):
    old, new = _tree(tmp_path / "old", FAKE_0_24), _tree(tmp_path / "new", FAKE_0_25)
    assert generation_for("0.24.1").name == "0.24" and generation_for("0.26.0").name == "0.25"
    assert generation_for("0.28.0").name == "0.25" and generation_for("0.30.0").name == "0.29"
    assert check_sources(new, CONTRACT_0_25) == [] and check_sources(old, CONTRACT) == []
    assert any("get_unstacked_mapper" in problem for problem in check_sources(new, CONTRACT))
    assert any("get_unstacked_mapper" in problem for problem in check_sources(old, CONTRACT_0_25))


def test_the_0_25_adapter_unstacks_the_mapper_and_marks_what_standby_unmaps():
    import types

    from trl_turbo.vllm.engine import APIS

    mapper = types.SimpleNamespace(get_unstacked_mapper=lambda: "unstacked")
    model = types.SimpleNamespace(hf_to_vllm_mapper=mapper)
    assert APIS["0.24"].lora_weights_mapper(model) is mapper
    assert APIS["0.25"].lora_weights_mapper(model) == "unstacked"
    assert APIS["0.25"].lora_weights_mapper(types.SimpleNamespace()) is None
    allocation = types.SimpleNamespace(is_asleep=False)
    APIS["0.25"].mark_mapped(allocation, False)
    assert allocation.is_asleep
    APIS["0.25"].mark_mapped(allocation, True)
    assert not allocation.is_asleep
    APIS["0.24"].mark_mapped(allocation, False)  # 0.24 tracks nothing
    assert not allocation.is_asleep


def test_verdicts(tmp_path):
    good = _tree(tmp_path / "good", FAKE_0_25)
    broken_files = dict(FAKE_0_25)
    broken_files["v1/worker/gpu_model_runner.py"] = "class GPUModelRunner:\n    pass\n"
    broken = _tree(tmp_path / "broken", broken_files)
    for verified in ("0.24.0", "0.26.0", "0.26.1"):  # GPU-verified: no check, no notice
        assert verdict(verified, None) == vllm_contract.Verdict(verified)
    accepted = verdict("0.27.1", good)
    assert accepted.error is None and "0.27.1 is not GPU-verified" in accepted.notice
    refused = verdict("0.28.0", broken)
    assert refused.notice is None and "vllm==0.28.0 changed" in refused.error
    assert "post_kv_cache_wake_up is missing" in refused.error
    assert "GPU-verified: 0.24.x, 0.25.x, 0.26.x" in refused.error
    assert "outside the range TRL 1.16 supports" in verdict("0.33.0", good).error
    assert "not installed" in verdict(None, None).error


def _grpo_config(**kwargs):
    from trl import GRPOConfig

    return GRPOConfig(output_dir="unused", report_to="none", use_cpu=True, use_vllm=True, vllm_mode="colocate",
                      **kwargs)


def test_config_accepts_a_contract_checked_version_with_one_notice_and_the_alarm_on_error(tmp_path, monkeypatch):
    as_if_vllm_installed(monkeypatch, "0.27.1", _tree(tmp_path, FAKE_0_25))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = _grpo_config(turbo_vllm_standby=True)
        again = _grpo_config(turbo_vllm_standby=True, turbo_rollout_check="off")
    notices = [w for w in caught if "not GPU-verified" in str(w.message)]
    assert len(notices) == 1
    assert config.turbo_rollout_check == "warn"  # the config is not changed by its checks
    assert rollout_check(Settings.of(config)) == "error" and rollout_check(Settings.of(again)) == "off"


def _without_bitsandbytes() -> dict[str, str]:
    return {k: v for k, v in FAKE_0_25.items() if "bitsandbytes" not in k}  # vLLM 0.28: bitsandbytes removed


def _with_fp8_refused() -> dict[str, str]:
    files = dict(FAKE_0_25)
    path = "model_executor/layers/quantization/fp8.py"
    files[path] = files[path].replace("self.is_checkpoint_fp8_serialized = is_checkpoint_fp8_serialized",
                                      "raise ValueError('use --quantization fp8_per_tensor')")
    return files


def test_the_0_29_generation_runs_without_the_kv_wake_up_hook_but_not_an_fp8_kv_cache_in_standby(tmp_path,
                                                                                                 monkeypatch):
    judged = verdict("0.30.0", _tree(tmp_path / "t", FAKE_0_29))
    assert judged.error is None
    assert {name for name, _ in judged.unavailable} == {vllm_contract.SHARED_4BIT, vllm_contract.FP8_KV_STANDBY}
    # the 0.25 generation's loader (unstacking) is a break for 0.29's contract
    files = dict(FAKE_0_29, **{"lora/worker_manager.py": FAKE_0_25["lora/worker_manager.py"]})
    assert "no longer has get_rename_mapper" in verdict("0.30.0", _tree(tmp_path / "u", files)).error
    as_if_vllm_installed(monkeypatch, "0.30.0", _tree(tmp_path / "installed", FAKE_0_29))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _grpo_config(turbo_vllm_standby=True)  # a 16-bit KV cache: the missing hook did nothing for it
            _grpo_config(turbo_vllm_standby=False, turbo_vllm_kv_cache_dtype="fp8")
            with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8'.*turbo_vllm_standby=True.*post_kv_cache"):
                _grpo_config(turbo_vllm_standby=True, turbo_vllm_kv_cache_dtype="fp8")
    finally:
        vllm_contract._installed_verdict.cache_clear()


@pytest.mark.parametrize("fp8_format", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_every_fp8_kv_cache_format_is_refused_in_standby_where_the_vllm_cannot_keep_it(tmp_path, monkeypatch,
                                                                                       fp8_format):
    as_if_vllm_installed(monkeypatch, "0.30.0", _tree(tmp_path / "installed", FAKE_0_29))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _grpo_config(turbo_vllm_standby=False, turbo_vllm_kv_cache_dtype=fp8_format)
            with pytest.raises(ValueError, match=rf"kv_cache_dtype='{fp8_format}'.*turbo_vllm_standby=True"):
                _grpo_config(turbo_vllm_standby=True, turbo_vllm_kv_cache_dtype=fp8_format)
    finally:
        vllm_contract._installed_verdict.cache_clear()


def test_the_0_29_adapter_renames_and_calls_the_wake_up_hook_only_where_it_exists():
    import types

    from trl_turbo.vllm.engine import APIS

    class Mapper:
        def get_rename_mapper(self):
            return "renamed"

        def get_unstacked_mapper(self):
            return "unstacked"

    model = types.SimpleNamespace(hf_to_vllm_mapper=Mapper())
    assert APIS["0.29"].lora_weights_mapper(model) == "renamed"
    assert APIS["0.25"].lora_weights_mapper(model) == "unstacked"
    calls = []
    APIS["0.29"].after_kv_wake_up(types.SimpleNamespace(post_kv_cache_wake_up=lambda: calls.append(1)))
    APIS["0.29"].after_kv_wake_up(types.SimpleNamespace())  # 0.29+: no hook, nothing to redo for a 16-bit cache
    assert calls == [1]
    with pytest.raises(AttributeError):
        APIS["0.25"].after_kv_wake_up(types.SimpleNamespace())  # older generations always have it


def test_a_feature_requirement_takes_away_only_that_feature(tmp_path):
    judged = verdict("0.28.0", _tree(tmp_path / "no-bnb", _without_bitsandbytes()))
    assert judged.error is None and "except those of shared 4-bit weights" in judged.notice
    assert "bitsandbytes_loader.py is missing" in judged.why_unavailable(vllm_contract.SHARED_4BIT)
    assert judged.why_unavailable(vllm_contract.FP8_SAMPLING) is None
    judged = verdict("0.27.1", _tree(tmp_path / "no-fp8", _with_fp8_refused()))
    assert judged.error is None and "fp8_per_tensor" in judged.why_unavailable(vllm_contract.FP8_SAMPLING)
    # a requirement every feature needs still refuses the version
    files = _without_bitsandbytes()
    del files["v1/worker/gpu_model_runner.py"]
    judged = verdict("0.28.0", _tree(tmp_path / "no-runner", files))
    assert judged.error is not None and "gpu_model_runner.py is missing" in judged.error


def test_fp8_sampling_is_refused_where_the_vllm_cannot_serve_it(tmp_path, monkeypatch):
    as_if_vllm_installed(monkeypatch, "0.27.1", _tree(tmp_path, _with_fp8_refused()))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert rollout_check(Settings.of(_grpo_config(turbo_vllm_shared_weights=True))) == "error"
            with pytest.raises(ValueError, match=r"turbo_vllm_sampling='fp8'.*cannot run on this vLLM.*fp8_per_tensor"):
                _grpo_config(turbo_vllm_shared_weights=True, turbo_vllm_sampling="fp8",
                             vllm_importance_sampling_mode="token_truncate")
    finally:
        vllm_contract._installed_verdict.cache_clear()


def test_expandable_segments_are_refused_beside_a_sleep_mode_pool_that_does_not_switch_them_off(tmp_path,
                                                                                                monkeypatch):
    files = dict(FAKE_0_25)
    files["device_allocator/cumem.py"] = files["device_allocator/cumem.py"].replace(
        'torch.cuda.memory._set_allocator_settings("expandable_segments:False")',
        'raise AssertionError("Expandable segments are not compatible with memory pool.")')
    as_if_vllm_installed(monkeypatch, "0.27.1", _tree(tmp_path, files))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert "_set_allocator_settings" in verdict("0.27.1", tmp_path / "vllm").why_unavailable(
                vllm_contract.EXPANDABLE_SEGMENTS)
            with pytest.raises(ValueError, match=r"turbo_expandable_segments=True.*sleep-mode memory pool.*0\.27\.1"):
                _grpo_config(turbo_vllm_standby=True, turbo_expandable_segments=True)
            _grpo_config(turbo_vllm_standby=True)  # the rest of the engine features run
            _grpo_config(turbo_expandable_segments=True)  # no sleep-mode pool in this run
    finally:
        vllm_contract._installed_verdict.cache_clear()


def test_4bit_weights_go_as_a_separate_copy_where_the_vllm_has_no_bitsandbytes(tmp_path, monkeypatch):
    from trl_turbo.vllm.sharing import copy_reasons

    nf4 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_quant_storage": "uint8"}
    as_if_vllm_installed(monkeypatch, "0.26.0", _tree(tmp_path / "verified", FAKE_0_25))
    assert copy_reasons(nf4, "llama") == []
    as_if_vllm_installed(monkeypatch, "0.28.0", _tree(tmp_path / "no-bnb", _without_bitsandbytes()))
    try:
        reasons = copy_reasons(nf4, "llama")
        assert len(reasons) == 1 and "cannot load 4-bit weights" in reasons[0] and "0.28.0" in reasons[0]
        assert copy_reasons(None, "llama") == []  # 16-bit weights are still shared
    finally:
        vllm_contract._installed_verdict.cache_clear()


def test_config_refuses_a_version_that_breaks_the_contract_naming_it(tmp_path, monkeypatch):
    files = dict(FAKE_0_25)
    files["lora/worker_manager.py"] = files["lora/worker_manager.py"].replace(
        "get_unstacked_mapper", "get_rename_mapper")
    as_if_vllm_installed(monkeypatch, "0.27.1", _tree(tmp_path, files))
    with pytest.raises(ValueError,
                       match=r"vllm==0.27.1 changed .*no longer has get_unstacked_mapper.*0.24.x, 0.25.x, 0.26.x"):
        _grpo_config(turbo_vllm_shared_weights=True)
    vllm_contract._installed_verdict.cache_clear()


CACHE = Path(__file__).resolve().parents[2] / ".cache" / "vllm-sources"


@pytest.mark.skipif(not (CACHE / "0.24.0" / "vllm").is_dir(), reason="run scripts/fetch_vllm_sources.py first")
def test_real_sources_keep_their_generation_contract():
    versions = sorted(path.name for path in CACHE.iterdir() if (path / "vllm").is_dir())
    kept = {version: check_sources(CACHE / version / "vllm", generation_for(version).contract) for version in versions}
    assert kept["0.24.0"] == []
    judged = {version: verdict(version, CACHE / version / "vllm") for version in versions}
    accepted = {version: judged[version].error is None for version in versions}
    assert all(accepted.values()), {v: judged[v].error for v in versions if not accepted[v]}
    for version in ("0.25.1", "0.26.0", "0.27.1"):
        if version in kept:
            assert kept[version] == [], (version, kept[version])
    lost = {version: {name for name, _ in judged[version].unavailable} for version in versions}
    expected = {"0.28.0": {vllm_contract.SHARED_4BIT},  # bitsandbytes removed
                "0.29.0": {vllm_contract.SHARED_4BIT, vllm_contract.FP8_KV_STANDBY},  # and the KV wake-up hook
                "0.30.0": {vllm_contract.SHARED_4BIT, vllm_contract.FP8_KV_STANDBY},
                "0.31.0": {vllm_contract.SHARED_4BIT, vllm_contract.FP8_KV_STANDBY, vllm_contract.FP8_SAMPLING}}
    assert {v: lost[v] for v in versions if v in expected} == {v: expected[v] for v in versions if v in expected}
