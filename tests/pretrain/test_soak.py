"""Soak: a multimodal run on the demo corpus killed again and again (SIGTERM and SIGKILL at random
steps, async checkpoints, restarts) ends with the same parameters, bit for bit, and the same loss
history as an uninterrupted run."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import yaml
from conftest import REPO
from test_multimodal_training import multimodal_run
from test_train import restored_params, tree_equal

from m3jax.config_loading import to_mapping
from pretrain.metrics import read_metrics

STEPS, EVERY = 240, 20  # checkpoints every EVERY steps
MAX_KILLS = 8  # then the run may finish
PATIENCE_S = 600  # a life that makes no progress for this long is a failure, not a wait


def _command(config, run_dir):
    return [sys.executable, "-m", "pretrain.train", "--config", str(config), "--run-dir",
            str(run_dir)]  # fmt: skip


def _last_logged(run_dir) -> int:
    records = read_metrics(run_dir / "metrics.jsonl")  # [] before the first step
    return records[-1]["step"] if records else 0


def _wait_for_step(process, run_dir, target) -> bool:
    """True once the run has logged `target` (False if it exited first)."""
    deadline = time.monotonic() + PATIENCE_S
    while process.poll() is None:
        try:
            if _last_logged(run_dir) >= target:
                return True
        except ValueError:  # a line being written
            pass
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"no step {target} within {PATIENCE_S} s")
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_soak_random_sigterm_and_sigkill_end_bit_identical(tmp_path):
    run = multimodal_run(
        train={"steps": STEPS},
        checkpoint={"every_steps": EVERY, "keep": 2, "async_save": True},
        logging={"every_steps": 1, "progress_bar": False, "tensorboard": False},
    )
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(to_mapping(run)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    quiet = {"cwd": REPO, "env": env, "stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE}
    straight = subprocess.run(_command(config, tmp_path / "straight"), **quiet, timeout=900)
    assert straight.returncode == 0, straight.stderr.decode()[-2000:]

    rng, kills = random.Random(22), {signal.SIGTERM: 0, signal.SIGKILL: 0}
    run_dir = tmp_path / "interrupted"
    while True:
        process = subprocess.Popen(_command(config, run_dir), **quiet)
        start = _last_logged(run_dir)
        if sum(kills.values()) >= MAX_KILLS:
            _, stderr = process.communicate(timeout=900)
            assert process.returncode == 0, stderr.decode()[-2000:]
            break
        # SIGKILL past the next checkpoint (sometimes while it is still being written); SIGTERM
        # anywhere: it saves the step it stops at
        sig = rng.choice([signal.SIGTERM, signal.SIGKILL])
        target = (
            start + rng.randint(1, 30)
            if sig == signal.SIGTERM
            else ((start // EVERY + 1) * EVERY + rng.randint(0, 10))
        )
        if not _wait_for_step(process, run_dir, min(target, STEPS)):
            assert process.wait() == 0, process.stderr.read().decode()[-2000:]
            break
        process.send_signal(sig)
        _, stderr = process.communicate(timeout=300)
        expected = {signal.SIGTERM: (128 + signal.SIGTERM, 0), signal.SIGKILL: (-signal.SIGKILL, 0)}
        assert process.returncode in expected[sig], stderr.decode()[-2000:]
        kills[sig] += process.returncode != 0

    assert kills[signal.SIGTERM] >= 2 and kills[signal.SIGKILL] >= 2, kills
    straight_dir = tmp_path / "straight"
    assert tree_equal(restored_params(straight_dir, STEPS), restored_params(run_dir, STEPS))

    def losses(directory):
        return [(r["step"], r["loss"]) for r in read_metrics(directory / "metrics.jsonl")]

    assert losses(run_dir) == losses(straight_dir)
    assert not [p for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name]
