"""What trl_turbo's engine code (`vllm/engine.py`, `vllm/standby.py`, `vllm/engine_plan.py`) requires of vLLM,
checked on vLLM's source, and whether the installed vLLM may run the engine features.

Design decision: a version trl_turbo cannot run on the GPU is judged by reading its source, never by importing it:
each requirement names a file of the `vllm` package, a class or function in it, the parameters trl_turbo passes, and
what its body must or must not contain where trl_turbo relies on a behaviour, not only a name (how vLLM's adapter
loader maps names, which allocations its allocator's wake-up remaps, whether its runner offers the KV wake-up hook).
Versions sharing those behaviours form an API generation with one contract, and `vllm/engine.py` one adapter.
`check_sources` parses the files with `ast`, so any version can be checked on any machine; the sources come from
`scripts/fetch_vllm_sources.py` (a git-ignored cache), and CI checks the checker on small fake trees. The installed vLLM
is judged the same way (its sources found without importing it): a GPU-verified version runs as is; another version
within TRL's range runs when its sources keep the contract, with a one-line notice and the rollout alarm raised to
"error"; any other gets a config-time error naming the version, what broke, and the supported versions. A requirement
only one feature needs (`Requirement.feature`: vLLM's bitsandbytes loader for shared 4-bit weights, its online fp8
layers for fp8 sampling, the runner's KV wake-up hook for an fp8 KV cache in standby) takes only that feature away where
it breaks: 4-bit weights then go to vLLM as a separate 16-bit copy, and asking for the other two is a config-time error
naming why.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from . import versions
from .versions import SUPPORTED_OPTIONAL, VLLM_ENGINE, VLLM_GPU_VERIFIED


def _base(version: str) -> Version:
    return Version(Version(version).base_version)


@dataclass(frozen=True)
class Requirement:
    used_for: str  # what trl_turbo does with it
    path: str  # relative to the `vllm` package directory
    qualname: str  # "Class.method", "Class" or "function"
    parameters: tuple[str, ...] = ()  # parameter names trl_turbo passes (the callable must accept them)
    body_has: tuple[str, ...] = ()  # identifiers/attributes its body must use
    body_lacks: tuple[str, ...] = ()  # identifiers, attributes or message fragments whose presence would change
    # what trl_turbo relies on
    feature: str | None = None  # the one feature that needs it (None: every engine feature does)


SHARED_4BIT = "shared 4-bit weights"
FP8_SAMPLING = "fp8 sampling"
FP8_KV_STANDBY = "an fp8 KV cache in standby"
EXPANDABLE_SEGMENTS = "expandable segments beside the sleep-mode memory pool"


# vLLM 0.24's generation: the adapter loader takes the model's mapper as is; allocations carry no sleep state.
CONTRACT_0_24: tuple[Requirement, ...] = (
    Requirement("adapters from tensors: the LoRA manager's loader, wrapped per engine", "lora/worker_manager.py",
                "WorkerLoRAManager._load_adapter", ("lora_request",),
                body_lacks=("get_unstacked_mapper", "get_rename_mapper")),
    Requirement("adapters from tensors: vLLM's own constructor", "lora/lora_model.py", "LoRAModel.from_lora_tensors",
                ("lora_model_id", "tensors", "peft_helper", "device", "dtype", "model_vocab_size", "weights_mapper",
                 "skip_prefixes")),
    Requirement("adapters from tensors: the adapter's config", "lora/peft_helper.py", "PEFTHelper.from_dict",
                ("config_dict",)),
    Requirement("adapters from tensors: the adapter's checks", "lora/peft_helper.py", "PEFTHelper.validate_legal",
                ("lora_config",)),
    Requirement("adapter requests", "lora/request.py", "LoRARequest", body_has=("lora_name", "lora_int_id")),
    Requirement("KV standby: the allocator", "device_allocator/cumem.py", "CuMemAllocator.get_instance"),
    Requirement("KV standby: remapping a tag's allocations", "device_allocator/cumem.py", "CuMemAllocator.wake_up",
                ("tags",), body_lacks=("is_asleep",)),
    Requirement("KV standby: unmapping", "device_allocator/cumem.py", "unmap_and_release", ("allocation_handle",)),
    Requirement("KV standby: mapping back", "device_allocator/cumem.py", "create_and_map", ("allocation_handle",)),
    Requirement("KV standby: what vLLM's wake-up redoes for the KV cache", "v1/worker/gpu_model_runner.py",
                "GPUModelRunner.post_kv_cache_wake_up"),
    Requirement("KV standby: the prefix cache after a wake-up", "entrypoints/llm.py", "LLM.reset_prefix_cache"),
    Requirement("expandable segments: the sleep-mode pool switches them off around itself", "device_allocator/cumem.py",
                "CuMemAllocator.use_memory_pool", body_has=("_set_allocator_settings",), feature=EXPANDABLE_SEGMENTS),
    Requirement("generation with a pushed adapter", "entrypoints/llm.py", "LLM.generate",
                ("prompts", "sampling_params", "use_tqdm", "lora_request")),
    Requirement("shared 4-bit weights: the loader fed the training model's bytes",
                "model_executor/model_loader/bitsandbytes_loader.py",
                "BitsAndBytesModelLoader._get_quantized_weights_iterator", ("model_name_or_path", "revision"),
                feature=SHARED_4BIT),
    Requirement("fp8 sampling: online per-tensor fp8 linear layers", "model_executor/layers/quantization/online/fp8.py",
                "Fp8PerTensorOnlineLinearMethod", feature=FP8_SAMPLING),
    Requirement("fp8 sampling: `quantization='fp8'` without a checkpoint", "model_executor/layers/quantization/fp8.py",
                "Fp8Config", body_lacks=("fp8_per_tensor",), feature=FP8_SAMPLING),
)


def _revised(contract: tuple[Requirement, ...], *requirements: Requirement) -> tuple[Requirement, ...]:
    """`contract` with each of `requirements` in place of the one naming the same callable, or added."""
    by_qualname = {requirement.qualname: requirement for requirement in requirements}
    kept = tuple(by_qualname.pop(item.qualname, item) for item in contract)
    return kept + tuple(by_qualname.values())


# vLLM 0.25's generation: the adapter loader unstacks the model's mapper itself (so must trl_turbo's, or q/k/v merge
# into one entry), and each allocation records whether it is asleep (set by standby when it unmaps one, so that a
# wake-up that remaps only sleeping allocations still remaps it).
CONTRACT_0_25: tuple[Requirement, ...] = _revised(
    CONTRACT_0_24,
    Requirement("adapters from tensors: the LoRA manager's loader, wrapped per engine (mapper unstacked)",
                "lora/worker_manager.py", "WorkerLoRAManager._load_adapter", ("lora_request",),
                body_has=("get_unstacked_mapper",)),
    Requirement("KV standby: remapping a tag's allocations marked asleep", "device_allocator/cumem.py",
                "CuMemAllocator.wake_up", ("tags",), body_has=("is_asleep", "create_and_map")),
    Requirement("KV standby: the allocation's sleep state", "device_allocator/__init__.py", "AllocationData",
                body_has=("is_asleep",)),
)


# vLLM 0.29's generation: the adapter loader renames (`get_rename_mapper`: renames only, stacked names kept apart), and
# the runner's KV wake-up hook is gone (sleep moved into a backend). Standby skips the hook where it is missing: for a
# 16-bit KV cache it did nothing; an fp8 KV cache needs its scales reset after a wake-up, which nothing here redoes, so
# that one combination is taken away.
CONTRACT_0_29: tuple[Requirement, ...] = _revised(
    CONTRACT_0_25,
    Requirement("adapters from tensors: the LoRA manager's loader, wrapped per engine (mapper renames only)",
                "lora/worker_manager.py", "WorkerLoRAManager._load_adapter", ("lora_request",),
                body_has=("get_rename_mapper",)),
    Requirement("an fp8 KV cache in standby: the runner's reset of KV scales after a wake-up",
                "v1/worker/gpu_model_runner.py", "GPUModelRunner.post_kv_cache_wake_up", feature=FP8_KV_STANDBY),
)


@dataclass(frozen=True)
class ApiGeneration:
    """vLLM versions `[low, high)` that share what trl_turbo relies on, and the contract they keep."""

    name: str
    low: str
    high: str
    contract: tuple[Requirement, ...]


GENERATIONS: tuple[ApiGeneration, ...] = (
    ApiGeneration("0.24", "0.24.0", "0.25.0", CONTRACT_0_24),
    ApiGeneration("0.25", "0.25.0", "0.29.0", CONTRACT_0_25),
    ApiGeneration("0.29", "0.29.0", "0.32.0", CONTRACT_0_29),
)
CONTRACT = CONTRACT_0_24  # the GPU-verified generation's


def generation_for(version: str) -> ApiGeneration | None:
    """The API generation a vLLM version belongs to (None: older than any)."""
    return next((g for g in GENERATIONS if Version(g.low) <= _base(version) < Version(g.high)), None)


def _find(tree: ast.Module, qualname: str) -> ast.AST | None:
    node: ast.AST = tree
    for part in qualname.split("."):
        body = getattr(node, "body", [])
        definitions = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        found = next((child for child in body if isinstance(child, definitions) and child.name == part), None)
        if found is None:
            return None
        node = found
    return node


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[set[str], bool]:
    arguments = function.args
    names = {a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)}
    return names, arguments.kwarg is not None


def _identifiers(node: ast.AST) -> tuple[set[str], list[str]]:
    """The names and attributes `node` uses, and its string constants."""
    used: set[str] = set()
    strings: list[str] = []
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            used.add(child.id)
        elif isinstance(child, ast.Attribute):
            used.add(child.attr)
        elif isinstance(child, ast.Constant) and isinstance(child.value, str):
            strings.append(child.value)
    return used, strings


def check_requirement(package: Path, requirement: Requirement,
                      parsed: dict[Path, ast.Module] | None = None) -> str | None:
    """Why `requirement` does not hold in the `vllm` package at `package` (None when it holds); `parsed` caches the
    files already read."""
    path = package / requirement.path
    where = f"{requirement.path}: {requirement.qualname}"
    if not path.is_file():
        return f"{requirement.path} is missing ({requirement.used_for})"
    parsed = {} if parsed is None else parsed
    if path not in parsed:
        parsed[path] = ast.parse(path.read_text(encoding="utf-8"), str(path))
    node = _find(parsed[path], requirement.qualname)
    if node is None:
        return f"{where} is missing ({requirement.used_for})"
    if requirement.parameters:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return f"{where} is not a function ({requirement.used_for})"
        names, open_keywords = _parameters(node)
        missing = [name for name in requirement.parameters if name not in names]
        if missing and not open_keywords:
            return f"{where} no longer takes {', '.join(missing)} ({requirement.used_for})"
    used, strings = _identifiers(node)
    absent = [name for name in requirement.body_has if name not in used and name not in strings]
    if absent:
        return f"{where} no longer has {', '.join(absent)} ({requirement.used_for})"
    changed = [name for name in requirement.body_lacks if name in used or any(name in text for text in strings)]
    if changed:
        return f"{where} now uses {', '.join(changed)}, which changes {requirement.used_for}"
    return None


def broken_requirements(package: Path, contract: tuple[Requirement, ...] = CONTRACT) -> list[tuple[Requirement, str]]:
    """Every requirement of `contract` that the vLLM sources at `package` (the `vllm` directory) break, with why."""
    parsed: dict[Path, ast.Module] = {}
    return [(requirement, problem) for requirement in contract
            if (problem := check_requirement(package, requirement, parsed)) is not None]


def check_sources(package: Path, contract: tuple[Requirement, ...] = CONTRACT) -> list[str]:
    """Why each requirement of `contract` that the vLLM sources at `package` break is broken."""
    return [problem for _, problem in broken_requirements(package, contract)]


@dataclass(frozen=True)
class Verdict:
    """Whether the engine features may run on a vLLM version: `error` (they may not, and why) or `notice` (they may,
    without GPU verification); both None for a GPU-verified version."""

    version: str | None
    error: str | None = None
    notice: str | None = None
    unavailable: tuple[tuple[str, str], ...] = ()  # (feature, why) for each feature this version cannot serve

    def why_unavailable(self, feature: str) -> str | None:
        """Why this vLLM cannot serve `feature` (None: it can, as far as the contract says)."""
        return next((why for name, why in self.unavailable if name == feature), None)


def installed_vllm_package() -> Path | None:
    """The installed `vllm` package directory, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def verdict(version: str | None, package: Path | None) -> Verdict:
    """The engine features' verdict on vLLM `version` whose sources are at `package`."""
    engine_low, engine_high = VLLM_ENGINE["vllm"]
    supported = (f"supported: >={engine_low},<{engine_high}, GPU-verified: "
                 + ", ".join(f"{minor}.x" for minor in VLLM_GPU_VERIFIED))
    if version is None:
        return Verdict(version, error=f"vLLM is not installed ({supported})")
    minor = ".".join(str(part) for part in _base(version).release[:2])
    if minor in VLLM_GPU_VERIFIED:
        return Verdict(version)
    low, high = SUPPORTED_OPTIONAL["vllm"]
    if not Version(low) <= _base(version) < Version(high):
        return Verdict(version, error=f"vllm=={version} is outside the range TRL 1.16 supports (>={low},<{high}); "
                                      f"{supported}")
    if package is None:
        return Verdict(version, error=f"vllm=={version}: its sources were not found to check ({supported})")
    generation = generation_for(version)
    if generation is None:
        return Verdict(version, error=f"vllm=={version} is older than any API generation. Supported: {supported}")
    broken = broken_requirements(package, generation.contract)
    problems = [problem for requirement, problem in broken if requirement.feature is None]
    if problems:
        return Verdict(version, error=f"vllm=={version} changed what trl_turbo's engine code relies on: "
                                      + "; ".join(problems) + f". Supported: {supported}")
    unavailable: dict[str, str] = {}
    for requirement, problem in broken:
        unavailable.setdefault(requirement.feature, f"vllm=={version}: {problem}")
    kept = ("every requirement trl_turbo checks" if not unavailable else
            "every requirement trl_turbo checks except those of "
            + "; ".join(f"{feature} ({why})" for feature, why in unavailable.items()))
    return Verdict(version, notice=f"vllm=={version} is not GPU-verified with trl_turbo's engine features "
                                   f"({supported}); its sources keep {kept}, so they run, with turbo_rollout_check "
                                   "raised from 'warn' to 'error'.", unavailable=tuple(unavailable.items()))


@functools.lru_cache(maxsize=4)
def _installed_verdict(version: str | None, package: Path | None) -> Verdict:
    return verdict(version, package)


def installed_verdict() -> Verdict:
    """The verdict on the installed vLLM (computed once per version)."""
    return _installed_verdict(versions.installed_version("vllm"), installed_vllm_package())
