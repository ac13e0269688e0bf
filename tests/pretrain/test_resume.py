"""Resume hygiene: the LR schedule is kept, training-only knobs may change, changed data and model
settings are named, and every CLI error is one line with exit code 2 (a traceback only with
--debug)."""

import shutil

import pytest
import yaml
from tiny import tiny_run

import pretrain.train
from m3jax.config_loading import to_mapping
from pretrain.metrics import read_metrics
from pretrain.resume_checks import schedule_steps
from pretrain.train import main, train


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """The tiny run, done: 6 of 6 steps, checkpoints at 3 and 6."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    train(tiny_run(), run_dir)
    return run_dir


def _copy(finished, tmp_path):
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


def _main(tmp_path, run_dir, run, *overrides):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(to_mapping(run)))
    return main(["--config", str(config), "--run-dir", str(run_dir), *overrides])


def test_continuing_keeps_the_lr_schedule_and_may_change_training_knobs(finished, tmp_path, capsys):
    run_dir = _copy(finished, tmp_path)
    knobs = {"remat": "full", "moe": {"bias_update_rate": 0.02}, "attention_impl": "xla",
             "msa_kernels": ["partial_bytes=1048576"]}  # training-only  # fmt: skip
    longer = tiny_run(train={"steps": 8}, model=knobs)
    summary = train(longer, run_dir)
    assert summary["start_step"] == 6 and summary["end_step"] == 8
    assert "this run's LR schedule decays over 6 steps: kept" in capsys.readouterr().out
    lr = {r["step"]: r["lr"] for r in read_metrics(run_dir / "metrics.jsonl")}
    floor = 3e-3 * 0.1  # optimizer.lr · min_lr_ratio
    assert lr[7] == pytest.approx(floor) and lr[8] == pytest.approx(floor)
    assert lr[6] > floor


def test_schedule_horizon_is_kept_unless_asked_for():
    lines = []
    run = tiny_run(train={"steps": 600})
    assert schedule_steps(run, None, 0, lines.append) == 600  # a fresh run
    assert schedule_steps(run, 200, 0, lines.append) == 600  # m3-import's step 0: nothing followed
    assert lines == []
    assert schedule_steps(run, 200, 200, lines.append) == 200
    assert "train.steps=600, but this run's LR schedule decays over 200 steps: kept" in lines[-1]
    asked = tiny_run(train={"steps": 600}, optimizer={"schedule_steps": 600})
    assert schedule_steps(asked, 200, 200, lines.append) == 600
    assert lines[-1].endswith("the LR schedule now decays over 600 steps (it was 200)")


def test_changed_data_settings_are_named(finished, tmp_path, capsys):
    run_dir = _copy(finished, tmp_path)
    changed = tiny_run(train={"steps": 8}, data={"seq_len": 16, "seed": 1})
    assert _main(tmp_path, run_dir, changed) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1
    assert "cannot resume with data.seq_len 32 → 16, data.seed 0 → 1: checkpoint 6's" in error[0]


def test_a_changed_nested_model_field_is_named(finished, tmp_path, capsys):
    run_dir = _copy(finished, tmp_path)
    assert _main(tmp_path, run_dir, tiny_run(model={"moe": {"num_experts": 2}})) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "holds a run with model.moe.num_experts=4, not 2;" in error[0]


def test_a_mesh_that_does_not_fit_is_one_line_and_leaves_nothing(tmp_path, capsys):
    assert _main(tmp_path, tmp_path / "run", tiny_run(mesh={"data": 3})) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error == [
        "m3-train: error: mesh {'data': 3, 'fsdp': 1, 'expert': 1, 'seq': 1, 'tensor': 1} needs 3 "
        "devices, found 4 (set mesh.* to fit the devices)"
    ]
    assert not (tmp_path / "run").exists()


def test_unexpected_errors_are_one_line_and_debug_shows_the_traceback(
    tmp_path, capsys, monkeypatch
):
    def broken(run, run_dir):
        raise TypeError("boom")

    monkeypatch.setattr(pretrain.train, "train", broken)
    assert _main(tmp_path, tmp_path / "run", tiny_run()) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "m3-train: error: unexpected TypeError: boom (--debug shows where)"
    ]
    with pytest.raises(TypeError, match="boom"):
        _main(tmp_path, tmp_path / "run", tiny_run(), "--debug")
