"""Multi-host training on one machine: two `m3-train` processes × 2 CPU devices, joined through
`jax.distributed` on localhost (gloo collectives), train like one process with 4 devices; a
SIGTERM to one of them stops both after the same step, both saving it; one process resumes the
checkpoint. Plus the multi-host helpers' own checks (pretrain/distributed.py)."""

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml
from conftest import REPO
from tiny import tiny_run

from m3jax.config_loading import to_mapping
from pretrain.distributed import data_item, initialize, own_data_state
from pretrain.metrics import read_metrics
from pretrain.train import train

COMPARED_STEPS = 4  # the 2-process run is stopped after these; losses compared over them
# One LR schedule for runs of any length, so that their first steps are the same.
SETTINGS = {
    "optimizer": {"schedule_steps": 6},
    "checkpoint": {"every_steps": 1000},  # saves only on the stop
    "logging": {"every_steps": 1, "progress_bar": False, "tensorboard": False},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_processes(config_path, run_dir, logs) -> list[subprocess.Popen]:
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",  # 2 devices per process
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
    }
    coordinator = f"127.0.0.1:{_free_port()}"
    processes = []
    for index in range(2):
        command = [
            sys.executable, "-m", "pretrain.train", "--config", str(config_path),
            "--run-dir", str(run_dir), "--coordinator", coordinator,
            "--num-processes", "2", "--process-id", str(index),
        ]  # fmt: skip
        log = (logs / f"process-{index}.log").open("w")
        processes.append(
            subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        )
    return processes


def _wait_for_step(run_dir, step: int, processes, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r["step"] >= step for r in read_metrics(run_dir / "metrics.jsonl")):
            return
        if any(p.poll() is not None for p in processes):
            return  # the caller reports the early exit with its log
        time.sleep(0.2)


@pytest.mark.slow
def test_two_processes_train_like_one_stop_together_and_resume_in_one(tmp_path):
    multi_dir, logs = tmp_path / "two-processes", tmp_path / "logs"
    logs.mkdir()
    config_path = tmp_path / "tiny.yaml"
    config_path.write_text(yaml.safe_dump(to_mapping(tiny_run(train={"steps": 1000}, **SETTINGS))))
    processes = _start_processes(config_path, multi_dir, logs)
    try:
        _wait_for_step(multi_dir, COMPARED_STEPS, processes)
        processes[1].send_signal(signal.SIGTERM)  # a preempted host: not the one that logs
        codes = [p.wait(timeout=300) for p in processes]
    finally:
        for p in processes:
            p.kill()
    output = {i: (logs / f"process-{i}.log").read_text() for i in range(2)}
    assert codes == [128 + signal.SIGTERM] * 2, output

    # the same losses as one process with 4 devices (same mesh data=4, same global batches)
    single = train(tiny_run(train={"steps": COMPARED_STEPS}, **SETTINGS), tmp_path / "one-process")
    assert single["end_step"] == COMPARED_STEPS
    losses = {
        name: [r["loss"] for r in read_metrics(d / "metrics.jsonl") if "nll" in r][:COMPARED_STEPS]
        for name, d in (("two", multi_dir), ("one", tmp_path / "one-process"))
    }
    np.testing.assert_allclose(losses["two"], losses["one"], rtol=2e-5)

    # both saved the same step: one complete checkpoint, holding both processes' data positions
    (stopped,) = [int(p.name) for p in (multi_dir / "checkpoints").iterdir() if p.name.isdigit()]
    assert stopped >= COMPARED_STEPS
    data = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(
        multi_dir / "checkpoints" / str(stopped) / "data"
    )
    assert data["process_count"] == 2
    assert [s["rows_emitted"] for s in data["processes"]] == [stopped * 4] * 2
    assert f"SIGTERM: checkpoint at step {stopped} saved" in output[0]
    assert output[1].count("m3-train") == 1, output[1]  # only the signal's note: one voice

    # one process (4 devices) resumes the 2-process checkpoint at the next batch
    resumed = train(tiny_run(train={"steps": stopped + 1}, **SETTINGS), multi_dir)
    assert (resumed["start_step"], resumed["end_step"]) == (stopped, stopped + 1)


def test_a_data_position_of_each_process_is_refused_on_another_process_count():
    saved = data_item([{"batches": 3, "grain": "a"}, {"batches": 3, "grain": "b"}])
    with pytest.raises(ValueError, match="saved by 2 processes.*resume it with 2 processes"):
        own_data_state(saved)  # this test runs in 1 process


def test_one_data_position_resumes_on_any_process_count():
    same = {"rows_emitted": 8}
    assert own_data_state(data_item([same, same])) == same
    assert own_data_state(same) == same  # a checkpoint from before multi-host support


def test_explicit_multihost_flags_go_together():
    partial = argparse.Namespace(coordinator="node-0:8476", num_processes=2, process_id=None)
    with pytest.raises(ValueError, match="go together"):
        initialize(partial)
    outside = argparse.Namespace(coordinator="node-0:8476", num_processes=2, process_id=2)
    with pytest.raises(ValueError, match="--process-id=2 is not in 0..1"):
        initialize(outside)


SLURM_STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[0-1]", "SLURM_PROCID": "1",
              "SLURM_LOCALID": "0"}  # fmt: skip
NO_FLAGS = argparse.Namespace(coordinator=None, num_processes=None, process_id=None)


@pytest.mark.parametrize(("tasks", "joins"), [("2", True), ("1", False)])
def test_an_srun_step_of_several_tasks_joins_through_jax_and_one_task_stays_alone(
    monkeypatch, tasks, joins
):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    for name, value in {**SLURM_STEP, "SLURM_NTASKS": tasks}.items():
        monkeypatch.setenv(name, value)
    initialize(NO_FLAGS)
    assert calls == ([((), {})] if joins else [])  # no arguments: jax reads SLURM's variables


def test_explicit_flags_join_and_no_flags_outside_a_launcher_change_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append(a))
    for name in (*SLURM_STEP, "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    initialize(NO_FLAGS)
    assert calls == []
    initialize(argparse.Namespace(coordinator="node-0:8476", num_processes=2, process_id=1))
    assert calls == [("node-0:8476", 2, 1)]
