"""Checkpoint faults: a failed save (disk full, injected as a write error) is reported in one line,
cleaned up and retried, or stops with exit code 2; a corrupt latest checkpoint falls back to the
newest intact one (or, by flag, stops) in one line instead of thousands of traceback lines."""

import collections
import errno
import logging
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml
from conftest import REPO
from orbax.checkpoint._src.handlers import json_checkpoint_handler
from tiny import tiny_run

from m3jax.config_loading import to_mapping
from pretrain.checkpointing import CheckpointError, Checkpoints
from pretrain.train import main, train

TMP_SUFFIX = ".orbax-checkpoint-tmp"


def _params(run_dir, step):
    state = ocp.StandardCheckpointer().restore(run_dir / "checkpoints" / str(step) / "state")
    return state["params"]


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def _steps(run_dir):
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def _leftovers(run_dir):
    return [p.name for p in (run_dir / "checkpoints").iterdir() if TMP_SUFFIX in p.name]


def _disk_full_when_saving(monkeypatch, failing):
    """Makes a write of a checkpoint's JSON items fail as on a full disk where `failing(step,
    earlier failures at that step)`, in Orbax's background commit (where a real ENOSPC would
    surface)."""
    real = json_checkpoint_handler.JsonCheckpointHandler._save_fn
    failures = collections.Counter()

    async def save(self, x, directory):
        step = int(directory.parent.name.split(".")[0])
        if failing(step, failures[step]):
            failures[step] += 1
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return await real(self, x, directory)

    monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", save)


def _train_with_a_failed_save(run, run_dir, step, monkeypatch, capsys) -> list[str]:
    """Trains the 6-step `run` to its end with the save of `step` failing once; the lines that
    report that failure."""
    _disk_full_when_saving(monkeypatch, lambda at, failures: at == step and not failures)
    assert train(run, run_dir)["end_step"] == 6
    out = capsys.readouterr().out
    return [line for line in out.splitlines() if f"checkpoint save at step {step} failed" in line]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The tiny 6-step run, checkpoints at 3 and 6."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    train(tiny_run(), run_dir)
    return run_dir


def test_failed_async_save_is_reported_retried_and_cleaned_up(
    straight, tmp_path, monkeypatch, capsys, caplog
):
    run = tiny_run(checkpoint={"async_save": True, "every_steps": 2})
    failed = _train_with_a_failed_save(run, tmp_path / "run", 4, monkeypatch, capsys)
    assert len(failed) == 1
    assert "[Errno 28] No space left on device (injected)" in failed[0]
    assert failed[0].endswith(
        "its temporary folder was removed, latest complete: step 2; retrying at the next step"
    )
    assert _steps(tmp_path / "run") == [2, 5, 6]  # 5: the retry, 6: the last step
    assert _leftovers(tmp_path / "run") == []
    _assert_same(_params(tmp_path / "run", 6), _params(straight, 6))  # no step was lost
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # Orbax's are dropped


def test_a_failed_save_is_not_retried_ahead_of_a_save_whose_state_a_step_copies(
    tmp_path, monkeypatch, capsys
):
    """checkpoint.copy_in_step: step 2's save fails in the background while step 4's waits for
    its copy; no retry (a plain save of step 5) overtakes it: step 4's save is the retry, or if
    step 2's failure surfaces only as step 4's save starts, the run's last save is."""
    run = tiny_run(checkpoint={"async_save": True, "every_steps": 2, "copy_in_step": True})
    assert len(_train_with_a_failed_save(run, tmp_path / "run", 2, monkeypatch, capsys)) == 1
    assert _steps(tmp_path / "run") in ([4, 6], [6])
    assert _leftovers(tmp_path / "run") == []


def test_a_save_failing_again_after_its_retry_stops_with_exit_2(tmp_path, monkeypatch, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(to_mapping(tiny_run(checkpoint={"every_steps": 2}))))
    _disk_full_when_saving(monkeypatch, lambda step, failed: step >= 4)  # the disk stays full
    assert main(["--config", str(config), "--run-dir", str(tmp_path / "run")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1
    assert error[0].startswith("m3-train: error: checkpoint save at step 5 failed: [Errno 28]")
    assert "(injected); it retried step 4's failed save; latest complete: step 2; stop" in error[0]
    assert _steps(tmp_path / "run") == [2] and _leftovers(tmp_path / "run") == []
    assert _params(tmp_path / "run", 2)  # the earlier checkpoint is intact


def _truncate_state(step_dir):
    for path in (step_dir / "state").rglob("*"):
        if path.is_file() and "ocdbt.process_" in str(path) and path.parent.name == "d":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_corrupt_latest_checkpoint_falls_back_to_the_newest_intact_one(straight, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    _truncate_state(run_dir / "checkpoints" / "6")
    summary = train(tiny_run(), run_dir)
    assert summary["start_step"] == 3 and summary["end_step"] == 6
    _assert_same(_params(run_dir, 6), _params(straight, 6))
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if "cannot restore checkpoint" in line]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"m3-train: warning: {run_dir / 'checkpoints' / '6'}: ")
    assert warnings[0].endswith("; moved it to 6.corrupt, restoring step 3")
    assert (run_dir / "checkpoints" / "6.corrupt" / "state").is_dir()


def test_corrupt_latest_checkpoint_can_be_refused(straight, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    _truncate_state(run_dir / "checkpoints" / "6")
    with pytest.raises(CheckpointError) as refused:
        train(tiny_run(checkpoint={"restore_older_if_corrupt": False}), run_dir)
    assert f"{run_dir / 'checkpoints' / '6'}: cannot restore checkpoint (" in str(refused.value)
    assert "restore_older_if_corrupt=false, so the older step 3 is not restored" in str(
        refused.value
    )
    assert _steps(run_dir) == [3, 6]  # nothing moved or written


def test_no_intact_checkpoint_is_one_line_not_thousands(straight, tmp_path):
    """A subprocess, to see everything the CLI prints: one line (the demo printed ~55K lines of
    asyncio and Orbax tracebacks for a truncated checkpoint)."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    for step in (3, 6):
        _truncate_state(run_dir / "checkpoints" / str(step))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(to_mapping(tiny_run())))
    result = subprocess.run(
        [sys.executable, "-m", "pretrain.train", "--config", str(config), "--run-dir",
         str(run_dir)],
        cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1, f"{len(lines)} lines: {result.stderr[:2000]}"
    assert f"{run_dir / 'checkpoints' / '6'}: cannot restore checkpoint (" in lines[0]
    assert "; the older checkpoints (steps 3) do not restore either" in lines[0]
    assert _steps(run_dir) == [3, 6]  # nothing moved or written


def test_an_unusable_checkpoint_directory_is_named_as_not_writable(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match=r"file/checkpoints: cannot open or create .*writ"):
        Checkpoints(tmp_path / "file" / "checkpoints", tiny_run().checkpoint)
