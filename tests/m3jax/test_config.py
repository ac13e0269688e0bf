"""Config loading: every shipped YAML parses; bad keys, types and values fail naming the key."""

import dataclasses

import pytest
import yaml
from conftest import REPO

from m3jax.config import ModelConfig, MoEConfig, MSAConfig, expand_layer_pattern
from m3jax.config_loading import ConfigError, apply_overrides, from_mapping, to_mapping
from pretrain.config import RunConfig, load_run_config

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def write(tmp_path, data, name="run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_configs_every_yaml_loads_and_round_trips():
    assert {p.name for p in CONFIGS} >= {"demo.yaml", "m3.yaml", "small-gpu.yaml"}
    for path in CONFIGS:
        run = load_run_config(path)
        assert from_mapping(RunConfig, to_mapping(run), where="round trip") == run


def test_config_unknown_key_is_named_with_suggestion(tmp_path):
    path = write(tmp_path, {"model": {"num_head": 4}})
    with pytest.raises(
        ConfigError, match=r"run.yaml: unknown key 'model.num_head' \(did you mean 'num_heads'\?\)"
    ):
        load_run_config(path)


def test_config_unknown_override_key_is_named():
    with pytest.raises(ConfigError, match="unknown key 'optimizer.learning_rate'"):
        load_run_config(REPO / "configs/demo.yaml", ["optimizer.learning_rate=1e-3"])


def test_config_wrong_type_is_named(tmp_path):
    path = write(tmp_path, {"model": {"num_layers": "four"}})
    with pytest.raises(ConfigError, match="'model.num_layers' must be int, got 'four'"):
        load_run_config(path)
    with pytest.raises(ConfigError, match="'data.batch_size' must be int, got True"):
        load_run_config(write(tmp_path, {"data": {"batch_size": True}}))
    with pytest.raises(ConfigError, match="'model.msa' must be a mapping"):
        load_run_config(write(tmp_path, {"model": {"msa": 3}}))


@pytest.mark.parametrize(
    "model, message",
    [
        ({"num_heads": 6, "num_kv_heads": 4}, "num_heads=6 is not a multiple of num_kv_heads=4"),
        (
            {"moe": {"num_experts": 4, "experts_per_token": 5}},
            "experts_per_token=5 exceeds moe.num_experts=4",
        ),
        ({"msa": {"index_heads": 2}}, "msa.index_heads=2 must equal num_kv_heads=4"),
        ({"num_layers": 59}, "layer_types lists 60 layers but num_layers=59"),
        ({"layer_types": ["full*59", "sliding*1"]}, r"layer_types\[59\]='sliding'"),
        ({"rotary_dim": 63}, "rotary_dim=63 must be even"),
        (
            {"msa": {"topk_blocks": 1, "local_blocks": 2}},
            "local_blocks=2 exceeds msa.topk_blocks=1",
        ),
        ({"msa": {"index_head_dim": 32}}, "index_head_dim=32 is smaller than rotary_dim=64"),
        ({"dtype": "float16"}, "dtype='float16' is not one of"),
        ({"num_kv_heads": 0}, "num_kv_heads=0 must be >= 1"),
        ({"vision": {"num_heads": 0}}, "vision.num_heads=0 must be >= 1"),
        ({"moe": {"expert_dim": -2}}, "moe.expert_dim=-2 must be >= 1"),
        ({"layer_types": ["full*x"]}, r"bad repeat count in 'full\*x'"),
        ({"moe": {"dispatch": "sparse"}}, "moe.dispatch='sparse' is not one of"),
        ({"moe": {"capacity_factor": 0}}, "moe.capacity_factor=0.0 must be > 0"),
        ({"moe": {"capacity_factor": -1.5}}, "moe.capacity_factor=-1.5 must be > 0"),
        ({"moe": {"exchange": "nccl"}}, "moe.exchange='nccl' is not one of"),
        ({"moe": {"exchange_factor": 0}}, "moe.exchange_factor=0.0 must be > 0"),
        ({"msa_kernels": ["partial_bytes"]}, "msa_kernels: 'partial_bytes' is not 'field=value'"),
        ({"msa_kernels": ["colour=red"]}, "msa_kernels: 'colour=red': Config has no field"),
        ({"msa_kernels": ["partial_bytes=lots"]}, "'partial_bytes=lots': partial_bytes is int"),
        ({"msa_kernels": ["mosaic.stage=2"]}, "'mosaic.stage=2': Tiling has no field 'stage'"),
    ],
)
def test_config_inconsistent_model_values_fail_at_load(tmp_path, model, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(write(tmp_path, {"model": model}))


def test_config_inconsistent_run_values_fail_at_load(tmp_path):
    with pytest.raises(ConfigError, match="seq_len=100 is not a multiple of mesh.seq=3"):
        load_run_config(write(tmp_path, {"data": {"seq_len": 100}, "mesh": {"seq": 3}}))
    with pytest.raises(ConfigError, match="at most one -1"):
        load_run_config(write(tmp_path, {"mesh": {"data": -1, "fsdp": -1}}))
    with pytest.raises(
        ConfigError, match="model.moe.num_experts=128 is not divisible by mesh.expert=3"
    ):
        load_run_config(write(tmp_path, {"mesh": {"data": 1, "expert": 3}}))


def test_config_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="missing.yaml: config file not found"):
        load_run_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="bad.yaml: malformed YAML"):
        load_run_config(write(tmp_path, "model: [1, 2\n", "bad.yaml"))
    with pytest.raises(ConfigError, match="list.yaml: top level must be a mapping"):
        load_run_config(write(tmp_path, "- 1\n", "list.yaml"))
    with pytest.raises(ConfigError, match="expected key=value"):
        load_run_config(REPO / "configs/demo.yaml", ["optimizer.lr"])


def test_config_overrides_set_nested_values_and_parse_scalars():
    run = load_run_config(
        REPO / "configs/demo.yaml",
        [
            "optimizer.lr=3e-4",
            "model.num_layers=2",
            "model.layer_types=[full, msa]",
            "model.mlp_layer_types=[dense, moe]",
            "model.msa.topk_blocks=2",
            "logging.tensorboard=false",
        ],
    )
    assert run.optimizer.lr == 3e-4 and isinstance(run.optimizer.lr, float)
    assert run.model.num_layers == 2 and run.model.msa.topk_blocks == 2
    assert run.model.layer_types == ("full", "msa")
    assert run.logging.tensorboard is False


def test_config_overrides_do_not_mutate_input():
    data = {"model": {"msa": {"block_size": 8}}}
    out = apply_overrides(data, ["model.msa.block_size=16"])
    assert data["model"]["msa"]["block_size"] == 8 and out["model"]["msa"]["block_size"] == 16


def test_layer_pattern_expands_repeats_in_order():
    assert expand_layer_pattern(("a*2", "b", "c*3"), "f") == ("a", "a", "b", "c", "c", "c")
    config = ModelConfig(
        num_layers=3,
        layer_types=("full", "msa*2"),
        mlp_layer_types=("dense*3",),
    )
    assert config.layer_types == ("full", "msa", "msa")
    assert dataclasses.replace(config) == config  # expansion is idempotent
    assert config.msa_layers == (1, 2) and config.moe_layers == ()


def test_layer_kinds_under_transformers_names_load_with_a_rename_message():
    """Configs (and saved run configs) from before `full | msa`, `dense | moe` keep loading."""
    with pytest.warns(UserWarning, match="layer_types: 'minimax_m3_sparse' is now 'msa'"):
        config = ModelConfig(
            num_layers=2,
            layer_types=("full_attention", "minimax_m3_sparse"),
            mlp_layer_types=("dense", "sparse"),
        )
    assert config.layer_types == ("full", "msa") and config.mlp_layer_types == ("dense", "moe")


def test_m3_defaults_match_the_released_shape():
    run = load_run_config(REPO / "configs/m3.yaml")
    # bias_update_rate is a training knob: m3.yaml keeps DeepSeek-V3's 1e-3 for M3-scale steps
    moe = dataclasses.replace(MoEConfig(), bias_update_rate=1e-3)
    assert run.model == dataclasses.replace(
        ModelConfig(), dtype="bfloat16", remat="full", vision=run.model.vision, moe=moe
    )
    assert run.model.msa == MSAConfig() and run.model.moe == moe
    assert run.model.layer_types[:3] == ("full",) * 3
    assert set(run.model.layer_types[3:]) == {"msa"} and len(run.model.layer_types) == 60
