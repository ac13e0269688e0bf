"""Checkpoint conversion without transformers: config.json rules, the safetensors format, and
load_pretrained's errors (transformers itself: tests/interop/test_hf_parity.py).

Every bad input must fail naming the tensor, file or config field at fault.
"""

import json

import jax
import ml_dtypes
import numpy as np
import pytest
from tiny import tiny_run, tiny_vision_run

import m3jax
from m3jax.config import ModelConfig
from m3jax.config_loading import ConfigError
from m3jax.convert.hf_config import from_hf_config, to_hf_config, with_training_fields
from m3jax.convert.layout import leaf_shapes, nested, tensor_specs
from m3jax.convert.pretrained import CheckpointFormatError
from m3jax.convert.safetensors_io import (
    SafetensorsDirectory,
    SafetensorsError,
    parse_size,
    plan_shards,
    write_file,
)

CONFIG = tiny_vision_run().model


def random_weights(config: ModelConfig, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    leaves = leaf_shapes(config).items()
    return nested({leaf: rng.normal(size=shape).astype(np.float32) for leaf, shape in leaves})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "model"
    weights = random_weights(CONFIG)
    m3jax.save_pretrained(CONFIG, weights, path, shard_size="20KB")
    return path, weights


def test_save_then_load_is_bit_exact_and_sharded(saved):
    path, weights = saved
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == files and len(files) > 3
    assert set(index["weight_map"]) == {spec.name for spec in tensor_specs(CONFIG)}
    config, loaded = m3jax.load_pretrained(path)
    assert with_training_fields(config, CONFIG) == CONFIG
    assert jax.tree.structure(loaded) == jax.tree.structure(weights)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(weights), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_save_bfloat16_rounds_each_value(tmp_path):
    weights = random_weights(CONFIG, seed=1)
    m3jax.save_pretrained(CONFIG, weights, tmp_path / "bf16", dtype="bfloat16")
    source = SafetensorsDirectory(tmp_path / "bf16")
    name = "language_model.model.embed_tokens.weight"
    assert source.file(name).dtype_name(name) == "BF16"
    _, loaded = m3jax.load_pretrained(tmp_path / "bf16")
    expected = weights["params"]["embed"].astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(loaded["params"]["embed"]), expected)


def test_save_refuses_a_non_empty_directory_unless_overwrite(saved, tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="is not empty; pass overwrite"):
        m3jax.save_pretrained(CONFIG, saved[1], tmp_path)
    (tmp_path / "model-00001-of-00099.safetensors").write_bytes(b"stale")
    m3jax.save_pretrained(CONFIG, saved[1], tmp_path, overwrite=True)
    assert (tmp_path / "notes.txt").exists()  # only checkpoint files are replaced
    assert not (tmp_path / "model-00001-of-00099.safetensors").exists()


def rewrite(source_dir, target_dir, edit) -> None:
    """Copies a checkpoint into one shard after `edit(dict of tensors)`."""
    source = SafetensorsDirectory(source_dir)
    tensors = {name: np.asarray(source.read(name)) for name in source.names()}
    edit(tensors)
    target_dir.mkdir()
    entries = [(name, tensor.shape) for name, tensor in tensors.items()]
    write_file(target_dir / "model.safetensors", entries, np.dtype(np.float32), tensors.values())
    (target_dir / "config.json").write_text((source_dir / "config.json").read_text())


NORM = "language_model.model.layers.1.post_attention_layernorm.weight"
EXPERT = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight"


MTP_NAME = "mtp.0.norm.weight"
LOAD_ERRORS = {
    "missing": (lambda t: t.pop(EXPERT), r"1 tensor\(s\) missing .*\[.*experts\.3\.w2"),
    "unexpected": (lambda t: t.update(extra=np.zeros(2)), r"unexpected .*extra in .*\.safetensors"),
    "shape": (
        lambda t: t.update({NORM: np.zeros(7)}),
        r"post_attention_layernorm\.weight in .* has shape \[7\], the config needs \[32\]",
    ),
    "mtp": (
        lambda t: t.update({MTP_NAME: np.zeros(3)}),
        r"prediction .*mtp\.0\.norm.*strict=False",
    ),
}


@pytest.mark.parametrize("edit, message", LOAD_ERRORS.values(), ids=LOAD_ERRORS)
def test_load_errors_name_the_tensor(saved, tmp_path, edit, message):
    rewrite(saved[0], tmp_path / "bad", edit)
    with pytest.raises(CheckpointFormatError, match=message):
        m3jax.load_pretrained(tmp_path / "bad")


def test_load_non_strict_skips_mtp_with_a_warning(saved, tmp_path):
    rewrite(saved[0], tmp_path / "mtp", LOAD_ERRORS["mtp"][0])
    with pytest.warns(UserWarning, match="skipping 1 multi-token-prediction"):
        _, loaded = m3jax.load_pretrained(tmp_path / "mtp", strict=False)
    np.testing.assert_array_equal(
        np.asarray(loaded["params"]["embed"]), saved[1]["params"]["embed"]
    )


def test_mtp_modules_save_as_mtp_tensors_and_load_back_strictly(tmp_path):
    config = tiny_vision_run(model={"mtp": {"num_modules": 2}}).model
    weights = random_weights(config, seed=3)
    m3jax.save_pretrained(config, weights, tmp_path / "model")
    index = json.loads((tmp_path / "model" / "model.safetensors.index.json").read_text())
    mtp = [name for name in index["weight_map"] if ".mtp." in name]
    assert "language_model.model.mtp.1.eh_proj.weight" in mtp
    assert "language_model.model.mtp.0.block_sparse_moe.experts.3.w2.weight" in mtp
    written = json.loads((tmp_path / "model" / "config.json").read_text())
    assert written["text_config"]["num_mtp_modules"] == 2
    loaded_config, loaded = m3jax.load_pretrained(tmp_path / "model")
    assert with_training_fields(loaded_config, config) == config
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(weights), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    with pytest.warns(UserWarning, match=f"skipping {len(mtp)} multi-token-prediction"):
        plain_config, plain = m3jax.load_pretrained(tmp_path / "model", strict=False)
    assert plain_config.mtp.num_modules == 0 and "mtp" not in plain["params"]
    np.testing.assert_array_equal(np.asarray(plain["params"]["embed"]), weights["params"]["embed"])


def test_load_strict_needs_the_mtp_tensors_config_json_asks_for(saved, tmp_path):
    rewrite(saved[0], tmp_path / "no_mtp", lambda t: None)
    config_path = tmp_path / "no_mtp" / "config.json"
    data = json.loads(config_path.read_text())
    data["text_config"]["num_mtp_modules"] = 1
    config_path.write_text(json.dumps(data))
    with pytest.raises(CheckpointFormatError, match=r"missing .*mtp\.0\..*--no-strict loads"):
        m3jax.load_pretrained(tmp_path / "no_mtp")
    assert m3jax.load_pretrained(tmp_path / "no_mtp", strict=False)[0].mtp.num_modules == 0


def test_safetensors_errors_name_the_file(tmp_path):
    (tmp_path / "broken.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(SafetensorsError, match="broken.safetensors: not a readable safetensors"):
        SafetensorsDirectory(tmp_path)
    (tmp_path / "broken.safetensors").unlink()
    write_file(tmp_path / "a.safetensors", [("x", (2,))], np.dtype(np.float32), [np.ones(2)])
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "a.safetensors", "y": "a.safetensors"}})
    )
    with pytest.raises(SafetensorsError, match="lists tensor 'y' in a.safetensors, which does not"):
        SafetensorsDirectory(tmp_path)


def test_shard_plan_and_sizes():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30
    assert parse_size("20kb") == 20_000 and parse_size(123) == 123
    with pytest.raises(ValueError, match="shard size 'five': expected a size like '5GB'"):
        parse_size("five")
    tensors = [("a", (10,)), ("b", (10,)), ("c", (30,)), ("d", (1,))]
    shards = plan_shards(tensors, np.dtype(np.float32), shard_size=80)
    assert [[name for name, _ in shard] for shard in shards] == [["a", "b"], ["c"], ["d"]]


# --------------------------------------------------------------------------------------------------
# config.json


def test_hf_config_round_trips_text_and_vision_models():
    all_moe = ModelConfig(num_layers=4, layer_types=("full*4",), mlp_layer_types=("moe*4",))
    for config in (CONFIG, tiny_run().model, all_moe):
        written = to_hf_config(config)
        assert (
            written["text_config"]["partial_rotary_factor"] == config.rotary_dim / config.head_dim
        )
        assert ("vision_config" in written) == (config.vision is not None)
        read = from_hf_config(json.loads(json.dumps(written)))
        assert with_training_fields(read, config) == config


def test_hf_config_reads_upstream_keys_with_transformers_precedence():
    text = to_hf_config(tiny_run().model)["text_config"]
    for key in ("layer_types", "mlp_layer_types", "rope_parameters", "index_block_size"):
        text.pop(key)
    text["sparse_attention_config"]["sparse_block_size"] = 8  # overrides the flat field
    config = from_hf_config({"model_type": "minimax_m3_vl", "text_config": text})
    assert config.layer_types == ("full", "msa")  # transformers' names mapped to ours
    assert config.mlp_layer_types == ("dense", "moe")
    assert config.msa.block_size == 8 and config.rotary_dim == 4 and config.vision is None


def test_hf_config_defaults_follow_transformers():
    """A bare config: transformers' defaults (every layer full attention + MoE, R = head_dim)."""
    config = from_hf_config(
        {"model_type": "minimax_m3_vl", "text_config": {"num_hidden_layers": 2}}
    )
    assert config.layer_types == ("full",) * 2 and config.mlp_layer_types == ("moe",) * 2
    assert config.rotary_dim == 128 and config.rope_theta == 5e6 and config.hidden_size == 6144


UNSUPPORTED = [  # (section, key, value, what the message says)
    ("text_config", "attention_output_gate", True, "attention_output_gate=True is not supported"),
    ("text_config", "n_shared_experts", 2, "text_config.n_shared_experts=2 is not supported"),
    ("text_config", "use_gemma_norm", False, "text_config.use_gemma_norm=False is not supported"),
    ("text_config", "sliding_window", 4096, "text_config.sliding_window=4096 is not supported"),
    ("text_config", "rope_parameters", {"rope_type": "yarn"}, "rope_type='yarn' is not supported"),
    ("text_config", "hidden_act", "gelu", "text_config.hidden_act='gelu' is not supported"),
    ("vision_config", "hidden_act", "quick_gelu", "hidden_act='quick_gelu' is not supported"),
    (None, "quantization_config", {"quant_method": "fp8"}, "quantization_config=.* not supported"),
    (None, "merged_hidden_size", 12, "merged_hidden_size=12 is not hidden_size"),
]


@pytest.mark.parametrize("section, key, value, message", UNSUPPORTED)
def test_hf_config_rejects_what_m3jax_does_not_support(section, key, value, message):
    data = to_hf_config(CONFIG)
    (data[section] if section else data)[key] = value
    with pytest.raises(ConfigError, match=f"config.json: .*{message}"):
        from_hf_config(data)


def test_hf_config_rotary_dim_without_partial_factor_is_ambiguous():
    data = to_hf_config(CONFIG)
    text = data["text_config"]
    text.pop("partial_rotary_factor")
    text["rope_parameters"].pop("partial_rotary_factor")
    with pytest.raises(
        ConfigError, match=r"rotary_dim=4 without partial_rotary_factor.*rotates all"
    ):
        from_hf_config(data)
