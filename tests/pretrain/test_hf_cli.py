"""m3-import and m3-export: a checkpoint becomes a run m3-train resumes, and a run becomes a
checkpoint again, bit-exact; bad input stops with exit code 2 and a message naming what is wrong."""

import errno
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml
from tiny import TINY_VISION, tiny_vision_run

import m3jax
from m3jax.convert import safetensors_io
from m3jax.convert.layout import leaf_shapes, nested
from m3jax.convert.safetensors_io import SafetensorsDirectory, SafetensorsFile, write_file
from m3jax.model import functional
from pretrain import hf_export, hf_import
from pretrain.config import load_run_config
from pretrain.optimizer import make_optimizer
from pretrain.train import train
from pretrain.train_step import init_state

RUN = tiny_vision_run(
    train={"steps": 2},
    checkpoint={"every_steps": 1},
    logging={"tensorboard": False},
    model={"vision": TINY_VISION, "remat": "save_dots"},
)
RUN_YAML = {  # everything but the architecture, which comes from config.json
    "data": {"source": "shakespeare", "seq_len": 32, "batch_size": 4},
    "optimizer": {"lr": 3e-3, "warmup_steps": 2},
    "train": {"steps": 2},
    "checkpoint": {"every_steps": 1, "keep": 5, "async_save": False},
    "logging": {"every_steps": 1, "progress_bar": False, "tensorboard": False},
    "model": {"remat": "save_dots", "moe": {"bias_update_rate": 0.01}},  # training-only fields
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A MiniMax-M3-VL checkpoint directory (written by m3jax) and its weights."""
    rng = np.random.default_rng(0)
    shapes = leaf_shapes(RUN.model).items()
    weights = nested({leaf: rng.normal(size=s).astype(np.float32) * 0.1 for leaf, s in shapes})
    path = tmp_path_factory.mktemp("hf") / "model"
    m3jax.save_pretrained(RUN.model, weights, path, shard_size="20KB")
    run_yaml = path.parent / "run.yaml"
    run_yaml.write_text(yaml.safe_dump(RUN_YAML))
    return path, weights, run_yaml


def restore(run_dir, step):
    return ocp.StandardCheckpointer().restore(run_dir / "checkpoints" / str(step) / "state")


def assert_trees_equal(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_import_resume_training_then_export_round_trips(checkpoint, tmp_path, capsys):
    hf_dir, weights, run_yaml = checkpoint
    run_dir = tmp_path / "run"
    args = ["--hf", str(hf_dir), "--output", str(run_dir), "--config", str(run_yaml)]
    assert hf_import.main(args) == 0
    run = load_run_config(run_dir / "config.yaml")
    assert run == RUN  # the architecture from config.json, the rest from run.yaml
    state = restore(run_dir, 0)
    assert int(state["step"]) == 0
    assert_trees_equal(state["params"], weights["params"])
    assert_trees_equal(state["buffers"], weights["buffers"])
    model = functional(run.model)
    optimizer = make_optimizer(run.optimizer, run.train.steps, model.param_axes)
    fresh = jax.eval_shape(lambda: init_state(model, optimizer, 0))["opt_state"]
    assert [x.shape for x in jax.tree.leaves(state["opt_state"])] == [
        x.shape for x in jax.tree.leaves(fresh)
    ]
    assert not any(np.any(x) for x in jax.tree.leaves(state["opt_state"]))  # AdamW starts at 0

    summary = train(run, run_dir)  # m3-train resumes the imported state
    assert "resuming at step 0" in capsys.readouterr().out
    assert summary["end_step"] == 2 and np.isfinite(summary["last_nll"])

    out = tmp_path / "export"
    assert (
        hf_export.main(["--run", str(run_dir), "--output", str(out), "--shard-size", "20KB"]) == 0
    )
    config, exported = m3jax.load_pretrained(out)
    assert config.vision == RUN.model.vision
    trained = restore(run_dir, 2)
    assert_trees_equal(exported["params"], trained["params"])
    assert_trees_equal(exported["buffers"], trained["buffers"])
    embed = np.asarray(exported["params"]["embed"])
    assert not np.array_equal(embed, weights["params"]["embed"])  # training moved it


def test_export_errors_name_the_problem(checkpoint, tmp_path, capsys):
    run_dir = tmp_path / "run"
    hf_dir, _, run_yaml = checkpoint
    assert (
        hf_import.main(["--hf", str(hf_dir), "--output", str(run_dir), "--config", str(run_yaml)])
        == 0
    )
    out = tmp_path / "out"
    out.mkdir()
    (out / "README").write_text("not a checkpoint")
    assert hf_export.main(["--run", str(run_dir), "--output", str(out)]) == 2
    assert "out is not empty; pass overwrite (--overwrite)" in capsys.readouterr().err
    assert hf_export.main(["--run", str(run_dir), "--output", str(out), "--overwrite"]) == 0
    assert hf_export.main(["--run", str(run_dir), "--step", "5", "--output", str(out)]) == 2
    assert "no checkpoint for step 5 (have [0])" in capsys.readouterr().err
    assert hf_export.main(["--run", str(tmp_path / "nowhere"), "--output", str(out)]) == 2
    assert "nowhere/config.yaml: not found" in capsys.readouterr().err


def test_import_strict_refuses_mtp_tensors_no_strict_skips_them(checkpoint, tmp_path, capsys):
    hf_dir, _, run_yaml = checkpoint
    with_mtp = tmp_path / "with_mtp"
    with_mtp.mkdir()
    source = SafetensorsDirectory(hf_dir)
    tensors = {name: np.asarray(source.read(name)) for name in source.names()}
    tensors["mtp.0.layers.0.input_layernorm.weight"] = np.zeros(32, np.float32)
    entries = [(name, tensor.shape) for name, tensor in tensors.items()]
    write_file(with_mtp / "model.safetensors", entries, np.dtype(np.float32), tensors.values())
    (with_mtp / "config.json").write_text((hf_dir / "config.json").read_text())
    args = ["--hf", str(with_mtp), "--config", str(run_yaml), "--output"]
    assert hf_import.main([*args, str(tmp_path / "strict")]) == 2
    assert "mtp.0.layers.0.input_layernorm.weight) outside the MTP modules of config.json's" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "strict" / "checkpoints").exists()
    assert hf_import.main([*args, str(tmp_path / "lenient"), "--no-strict"]) == 0
    assert "warning: skipping 1 multi-token-prediction tensor(s)" in capsys.readouterr().err


def test_import_refuses_a_different_architecture_or_a_used_run_dir(checkpoint, tmp_path, capsys):
    hf_dir, _, run_yaml = checkpoint
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump({**RUN_YAML, "model": {"hidden_size": 64}}))
    args = ["--hf", str(hf_dir), "--output", str(tmp_path / "run"), "--config"]
    assert hf_import.main([*args, str(changed)]) == 2
    assert "model.hidden_size=64 differs from the checkpoint's config.json (32)" in (
        capsys.readouterr().err
    )
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("{}")
    assert hf_import.main([*args, str(run_yaml)]) == 2
    assert "is not empty; m3-import writes a new run directory" in capsys.readouterr().err


def test_mtp_modules_round_trip_through_import_and_export(tmp_path, capsys):
    """m3-import (strict) reads the num_mtp_modules MTP modules; m3-export writes them back."""
    model = tiny_vision_run(model={"vision": TINY_VISION, "mtp": {"num_modules": 1}}).model
    rng = np.random.default_rng(1)
    shapes = leaf_shapes(model).items()
    weights = nested({leaf: rng.normal(size=s).astype(np.float32) * 0.1 for leaf, s in shapes})
    m3jax.save_pretrained(model, weights, tmp_path / "hf")
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(yaml.safe_dump({**RUN_YAML, "model": {"mtp": {"loss_weight": 0.1}}}))
    run_dir = tmp_path / "run"
    assert hf_import.main(["--hf", str(tmp_path / "hf"), "--output", str(run_dir),
                           "--config", str(run_yaml)]) == 0  # fmt: skip
    run = load_run_config(run_dir / "config.yaml")
    assert (run.model.mtp.num_modules, run.model.mtp.loss_weight) == (1, 0.1)
    state = restore(run_dir, 0)
    assert_trees_equal(state["params"]["mtp"], weights["params"]["mtp"])
    assert_trees_equal(state["buffers"], weights["buffers"])
    out = tmp_path / "export"
    assert hf_export.main(["--run", str(run_dir), "--output", str(out)]) == 0
    _, exported = m3jax.load_pretrained(out)
    assert_trees_equal(exported["params"], weights["params"])
    assert hf_import.main(["--hf", str(out), "--output", str(tmp_path / "plain"), "--config",
                           str(run_yaml), "--no-strict"]) == 0  # fmt: skip
    assert "warning: skipping" in capsys.readouterr().err
    assert load_run_config(tmp_path / "plain" / "config.yaml").model.mtp.num_modules == 0


def _broken_copy(hf_dir, tmp_path, damage):
    """A copy of the checkpoint whose last shard `damage(path, file)` changes; returns both."""
    copy = tmp_path / "broken"
    shutil.copytree(hf_dir, copy)
    shard = sorted(copy.glob("model-*.safetensors"))[-1]
    damage(shard, SafetensorsFile(shard))
    return copy, shard


def _import_fails(hf_dir, run_yaml, tmp_path, capsys):
    output = tmp_path / "out" / "run"
    args = ["--hf", str(hf_dir), "--output", str(output), "--config", str(run_yaml)]
    assert hf_import.main(args) == 2
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in stderr  # the rest: the progress bar
    assert not output.exists()
    assert not output.parent.exists() or not list(output.parent.iterdir())  # no staging left
    return errors[0]


def test_import_of_a_truncated_shard_names_file_and_tensor_and_leaves_nothing(
    checkpoint, tmp_path, capsys
):
    hf_dir, _, run_yaml = checkpoint

    def truncate(path, file):
        path.write_bytes(path.read_bytes()[: path.stat().st_size - 16])

    broken, shard = _broken_copy(hf_dir, tmp_path, truncate)
    last = max(SafetensorsFile(hf_dir / shard.name).entries.items(),
               key=lambda item: item[1]["data_offsets"][1])[0]  # fmt: skip
    error = _import_fails(broken, run_yaml, tmp_path, capsys)
    assert f"m3-import: error: {shard}: tensor {last!r} needs data bytes" in error
    assert "truncated or corrupt" in error


def test_import_of_a_tensor_holding_nan_names_it_and_leaves_nothing(checkpoint, tmp_path, capsys):
    hf_dir, _, run_yaml = checkpoint
    damaged = {}

    def poison(path, file):
        name = file.names()[0]
        data = bytearray(path.read_bytes())
        begin = file._data_start + file.entries[name]["data_offsets"][0]
        data[begin : begin + 4] = b"\xff\xff\xff\xff"  # a float32 NaN
        path.write_bytes(bytes(data))
        damaged["name"] = name

    broken, shard = _broken_copy(hf_dir, tmp_path, poison)
    error = _import_fails(broken, run_yaml, tmp_path, capsys)
    assert f"{damaged['name']} in {shard} holds NaN or infinity" in error


def test_export_writes_aside_and_a_failed_one_leaves_the_output_untouched(
    checkpoint, tmp_path, capsys, monkeypatch
):
    hf_dir, _, run_yaml = checkpoint
    run_dir = tmp_path / "run"
    args = ["--hf", str(hf_dir), "--output", str(run_dir), "--config", str(run_yaml)]
    assert hf_import.main(args) == 0
    out = tmp_path / "export"
    args = ["--run", str(run_dir), "--output", str(out), "--shard-size", "20KB"]
    real_write = safetensors_io.write_file
    written = []

    def disk_full_at_the_second_shard(path, *rest, **kwargs):
        written.append(path)
        if len(written) == 2:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real_write(path, *rest, **kwargs)

    monkeypatch.setattr(safetensors_io, "write_file", disk_full_at_the_second_shard)
    assert hf_export.main(args) == 2
    assert "No space left on device (injected)" in capsys.readouterr().err
    assert written[0].parent.name.startswith(".export.tmp-")  # written beside, not into, --output
    assert not out.exists() and not list(tmp_path.glob(".export*"))
    monkeypatch.setattr(safetensors_io, "write_file", real_write)
    assert hf_export.main(args) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(safetensors_io, "write_file", disk_full_at_the_second_shard)
    written.clear()
    assert hf_export.main([*args, "--overwrite"]) == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the old export is intact
    assert not list(tmp_path.glob(".export*"))
