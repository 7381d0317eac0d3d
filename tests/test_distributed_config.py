"""Multi-process strategies on CPU: which strategy a run trains with, and what config validation does for every
strategy × feature combination, before any model loads."""

from __future__ import annotations

import json
import types
import warnings

import pytest
from helpers import as_if_vllm_installed

from trl_turbo import distributed, losses
from trl_turbo.checks import check_config
from trl_turbo.distributed import FEATURE_STRATEGIES, Strategy, detect_strategy, local_process_count

_LAUNCH_ENV = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE", "ACCELERATE_DEEPSPEED_CONFIG_FILE",
               "ACCELERATE_USE_FSDP", "FSDP_VERSION", "LOCAL_WORLD_SIZE")

# What `accelerate launch --config_file <TRL's accelerate_configs/NAME.yaml> --num_processes 2` puts in the
# environment, and the world size the processes then see.
LAUNCHES: dict[Strategy, tuple[dict[str, str], int]] = {
    Strategy.SINGLE: ({}, 1),
    Strategy.DDP: ({}, 2),
    Strategy.ZERO1: ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1"}, 2),
    Strategy.ZERO2: ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}, 2),
    Strategy.ZERO3: ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, 2),
    Strategy.FSDP1: ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, 2),
    Strategy.FSDP2: ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, 2),
}
WHOLE = {Strategy.SINGLE, Strategy.DDP, Strategy.ZERO1, Strategy.ZERO2}


@pytest.fixture(autouse=True)
def _clean_launch_env(monkeypatch):
    for name in _LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)


def _args(world_size: int = 1, **fields):
    """GRPOConfig-like arguments as validation sees them (a real GRPOConfig under DeepSpeed needs deepspeed)."""
    from trl import GRPOConfig

    defaults = {field.name: field.default for field in GRPOConfig.__dataclass_fields__.values()
                if not callable(field.default)}
    defaults["gradient_checkpointing"] = False  # tests of the checkpointing features turn it on
    defaults["steps_per_generation"] = defaults["gradient_accumulation_steps"]  # as GRPOConfig.__post_init__ sets it
    return types.SimpleNamespace(**{**defaults, "world_size": world_size, "deepspeed_plugin": None, "fsdp": None,
                                    "fsdp_config": None, "output_dir": "unused", **fields})


def _launch(monkeypatch, strategy: Strategy) -> int:
    env, world_size = LAUNCHES[strategy]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return world_size


@pytest.mark.parametrize("strategy", list(Strategy), ids=lambda s: s.name)
def test_strategy_is_read_from_the_launch_environment(monkeypatch, strategy):
    world_size = _launch(monkeypatch, strategy)
    assert detect_strategy(_args(world_size)) is strategy


def test_strategy_from_training_arguments_and_deepspeed_config_files(monkeypatch, tmp_path):
    config_file = tmp_path / "ds.json"
    config_file.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert detect_strategy(_args(2, deepspeed=str(config_file))) is Strategy.ZERO3
    assert detect_strategy(_args(2, deepspeed={"zero_optimization": {"stage": 1}})) is Strategy.ZERO1
    assert detect_strategy(_args(2, deepspeed={"zero_optimization": {"stage": "auto"}},
                                 deepspeed_plugin=types.SimpleNamespace(zero_stage=3))) is Strategy.ZERO3
    assert detect_strategy(_args(1, fsdp=["full_shard"], fsdp_config={"version": 2})) is Strategy.FSDP2
    assert detect_strategy(_args(1, fsdp=["full_shard"], fsdp_config={"version": 1})) is Strategy.FSDP1
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(config_file))
    assert detect_strategy(_args(2)) is Strategy.ZERO3  # the file's stage, as accelerate reads it
    assert detect_strategy(_args(1)) is Strategy.ZERO3  # ZeRO shards even a single process's optimizer


@pytest.mark.parametrize("transformers_version", ["5.17.0", "5.23.0"])
@pytest.mark.parametrize("strategy", list(Strategy), ids=lambda s: s.name)
def test_offload_and_tiles_stay_off_with_a_warning_only_where_layers_cannot_reach_whole_parameters(
        monkeypatch, strategy, transformers_version):
    """Whole parameters per rank: on. FSDP2: on from transformers 5.23 (a layer checkpoints its forward inside
    FSDP2's hooks), before that off with the upgrade named. ZeRO-3, FSDP1: off."""
    monkeypatch.setattr("trl_turbo.versions.installed_version", lambda package: transformers_version)
    args = _args(_launch(monkeypatch, strategy), gradient_checkpointing=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_config(args)
    ours = [w for w in caught if "trl_turbo" in str(w.message)]
    runs = strategy in WHOLE or (strategy is Strategy.FSDP2 and transformers_version >= "5.23")
    assert (strategy in distributed.checkpointing_strategies()) is runs
    if runs:
        assert not ours
    else:
        assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning)
        message = str(ours[0].message)
        assert "`turbo_offload_checkpoints` and `turbo_tiled_mlp`" in message and strategy.value in message
        assert "DDP, ZeRO-1/2 and FSDP2 (with transformers >= 5.23)" in message  # names the alternatives
        if strategy is Strategy.FSDP2:
            assert "transformers 5.17.0: `pip install 'transformers>=5.23'`" in message
    from trl_turbo.run_plan import strategy_refusal

    assert (strategy_refusal(args) is None) is runs


def test_no_warning_when_the_features_are_off_or_checkpointing_is(monkeypatch):
    _launch(monkeypatch, Strategy.ZERO3)
    for fields in ({"gradient_checkpointing": False},
                   {"gradient_checkpointing": True, "turbo_offload_checkpoints": False, "turbo_tiled_mlp": False}):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_config(_args(2, **fields))


@pytest.mark.parametrize("strategy", list(Strategy), ids=lambda s: s.name)
def test_shared_weights_are_refused_before_loading_where_weights_are_sharded(monkeypatch, strategy):
    as_if_vllm_installed(monkeypatch)
    world_size = _launch(monkeypatch, strategy)
    engine = {"use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": False}
    check_config(_args(world_size, turbo_vllm_standby=True, **engine))  # standby: every strategy
    shared = _args(world_size, turbo_vllm_shared_weights=True, turbo_vllm_standby=True, **engine)
    if strategy in WHOLE or strategy is Strategy.FSDP2:
        check_config(shared)
    else:
        with pytest.raises(ValueError, match=rf"{strategy.value}.*Train with DDP.*FSDP2.*turbo_vllm_standby=True"):
            check_config(shared)


ENGINE = {"use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": False}


@pytest.mark.parametrize("strategy", sorted(WHOLE - {Strategy.SINGLE}, key=str), ids=lambda s: s.name)
def test_a_tensor_parallel_engine_shares_only_fsdp2_shards(monkeypatch, strategy):
    """With whole weights per rank (DDP, ZeRO-1/2) a TP engine holds slices nothing could view: refused, naming
    FSDP2; standby alone runs at any TP size."""
    as_if_vllm_installed(monkeypatch)
    world_size = _launch(monkeypatch, strategy)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world_size))
    check_config(_args(world_size, vllm_tensor_parallel_size=2, turbo_vllm_standby=True, **ENGINE))
    with pytest.raises(ValueError, match=rf"vllm_tensor_parallel_size=2.*{strategy.value}.*fsdp2.yaml"):
        check_config(_args(world_size, vllm_tensor_parallel_size=2, turbo_vllm_shared_weights=True, **ENGINE))


def test_fsdp2_sharing_refusals_name_the_fix(monkeypatch):
    as_if_vllm_installed(monkeypatch)
    world_size = _launch(monkeypatch, Strategy.FSDP2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world_size))
    shared = {"turbo_vllm_shared_weights": True, **ENGINE}
    check_config(_args(world_size, vllm_tensor_parallel_size=world_size, **shared))
    check_config(_args(world_size, vllm_tensor_parallel_size=1, **shared))  # shard groups of one: whole weights
    with pytest.raises(ValueError, match="must divide the 2 processes per node.*Sizes that fit: \\[1, 2\\]"):
        check_config(_args(world_size, vllm_tensor_parallel_size=4, **shared))
    check_config(_args(world_size, vllm_tensor_parallel_size=2, turbo_vllm_sampling="merged", **shared))
    check_config(_args(world_size, vllm_tensor_parallel_size=2, turbo_vllm_sampling="fp8",  # an fp8 copy per shard
                       vllm_importance_sampling_mode="token_truncate", **shared))
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    with pytest.raises(ValueError, match="fsdp_offload_params"):
        check_config(_args(world_size, vllm_tensor_parallel_size=2, **shared))


def test_features_every_strategy_supports_validate_everywhere(monkeypatch):
    """The fused loss, its loss variants and IS modes have no strategy condition (TRL gathers the head weight under
    ZeRO-3/FSDP; the loss reduces like TRL's); their validation passes under every strategy."""
    assert set(FEATURE_STRATEGIES) == {"turbo_offload_checkpoints", "turbo_tiled_mlp", "turbo_vllm_shared_weights",
                                       "turbo_offload_optimizer_states"}
    for strategy in Strategy:
        with monkeypatch.context() as scoped:
            world_size = _launch(scoped, strategy)
            for loss_type in losses.LOSS_TYPES:
                check_config(_args(world_size, loss_type=loss_type, turbo_fused_loss=True))
            for mode in losses.IS_MODES:
                check_config(_args(world_size, use_vllm=True, vllm_mode="colocate", turbo_fused_loss=True,
                                            vllm_importance_sampling_mode=mode))


def test_local_process_count_divides_the_host(monkeypatch):
    assert local_process_count() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert local_process_count() == 4


def test_real_config_under_an_fsdp2_launch_warns_once(monkeypatch, tmp_path):
    from trl import GRPOConfig

    monkeypatch.setattr("trl_turbo.versions.installed_version", lambda package: "5.22.0")
    _launch(monkeypatch, Strategy.FSDP2)
    with pytest.warns(RuntimeWarning, match="stay off in this run.*transformers>=5.23.*FSDP2"):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", gradient_checkpointing=True)
