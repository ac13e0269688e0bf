"""The training loop end to end: loss falls, resume is exact, signals checkpoint, bad input stops."""

import dataclasses
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml

from conftest import REPO
from m3jax.attention_ops import documents_bound
from m3jax.config_loading import to_mapping
from m3jax.model import functional
from pretrain.metrics import read_metrics
from pallas_kernels import target
from pretrain.checkpointing import Checkpoints
from pretrain.data_loading import make_loader
from pretrain.session import TrainingSession
from pretrain.train import main, train
from tiny import tiny_run


def restored_params(run_dir, step):
    checkpointer = ocp.StandardCheckpointer()
    return checkpointer.restore(run_dir / "checkpoints" / str(step) / "state")["params"]


def tree_equal(a, b):
    return all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def write_config(tmp_path, run):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(to_mapping(run)))
    return path


def test_train_loss_falls_on_shakespeare(tmp_path):
    run = tiny_run(train={"steps": 40}, logging={"every_steps": 10}, checkpoint={"every_steps": 40})
    summary = train(run, tmp_path / "run")
    assert summary["end_step"] == 40
    assert summary["last_nll"] < summary["first_nll"] - 1.0  # byte-level: ~5.6 -> < 4.6
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 10, 20, 30, 40]
    assert {
        "loss",
        "nll",
        "grad_norm",
        "lr",
        "tokens_per_s",
        "expert_imbalance",
        "expert_imbalance_layer1",
        "moe_idle_experts",
        "balance_loss",
    } <= set(records[-1])
    assert records[-1]["moe_dropped_fraction"] == 0  # dropless: nothing to drop
    assert records[-1]["moe_exchange_worst_case"] == 0  # one device: no exchange
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


def test_train_resume_matches_uninterrupted_run(tmp_path):
    # MSA warm-up over steps 1-4: the step-3 checkpoint is mid-warm-up, steps 5-6 are sparse
    run = tiny_run(model={"msa": {"warmup_tokens": 4 * 4 * 32}}, logging={"msa_recall_every": 2})
    train(run, tmp_path / "straight")
    interrupted = tmp_path / "interrupted"
    train(run, interrupted)
    # Simulate a kill right after the step-3 checkpoint: later checkpoints never happened.
    shutil.rmtree(interrupted / "checkpoints" / "6")
    summary = train(run, interrupted)
    assert summary["start_step"] == 3 and summary["end_step"] == 6
    assert tree_equal(restored_params(tmp_path / "straight", 6), restored_params(interrupted, 6))
    straight = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    resumed = read_metrics(interrupted / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]  # lines past step 3 were rewritten once
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    assert [r["msa_warmup"] for r in resumed] == [1, 1, 1, 1, 0, 0]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_from_the_next_step_s_copy_equals_the_plain_save(tmp_path, async_save):
    """checkpoint.copy_in_step: step 3's state comes from the copy that step 4 makes of the state
    it starts from (pinned host memory, beside the step), saved once step 5 is dispatched; the
    checkpoint equals the plain save's in every leaf, its data position and progress, and a run
    resumed from it trains on alike. The run's last save (step 6) is a plain one."""
    checkpoint = {"async_save": async_save}
    plain = tiny_run(checkpoint=checkpoint)
    copying = tiny_run(checkpoint={**checkpoint, "copy_in_step": True})
    train(plain, tmp_path / "plain")
    events = []  # steps dispatched (True: a copying one) and saves started, in order
    real_save, real_step = Checkpoints.save, TrainingSession.step_on_devices

    def save(checkpoints, step, state, data_state, progress):
        events.append((step, {x.sharding.memory_kind for x in jax.tree.leaves(state)}))
        real_save(checkpoints, step, state, data_state, progress)

    def step_on_devices(session, batch, mode, copy_state=False):
        events.append(copy_state)
        return real_step(session, batch, mode, copy_state)

    with (mock.patch.object(Checkpoints, "save", save),
          mock.patch.object(TrainingSession, "step_on_devices", step_on_devices)):  # fmt: skip
        train(copying, tmp_path / "copied")
    assert events == [False, False, False, True, False, (3, {"pinned_host"}), False,
                      (6, {"device"})]  # fmt: skip
    for name in ("state", "data", "progress"):
        item = lambda run_dir: checkpoint_item(run_dir, 3, name)  # noqa: E731
        assert tree_equal(item(tmp_path / "plain"), item(tmp_path / "copied"))
    shutil.rmtree(tmp_path / "copied" / "checkpoints" / "6")
    summary = train(copying, tmp_path / "copied")
    assert summary["start_step"] == 3 and summary["end_step"] == 6
    losses = [[r["loss"] for r in read_metrics(tmp_path / d / "metrics.jsonl")]
              for d in ("plain", "copied")]  # fmt: skip
    assert len(losses[0]) == len(losses[1]) == 6  # step 4 ran as two programs: to rounding
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)


def test_the_step_beside_a_copy_runs_as_two_halves_that_equal_the_step():
    """The step beside a save's copy of its state runs as its gradients, which only read the
    state while it is copied, then its update, which donates it: the copy is the state the step
    began from, the new state and metrics are the one program's (to rounding: XLA compiles the
    two apart), and the gradients' program needs no second state beside the donating step's."""
    run = tiny_run(checkpoint={"copy_in_step": True})
    session = TrainingSession(functional(run.model), run, None, report=lambda _: None)
    session.initialize()
    loader = make_loader(run)
    session.step(next(loader), session.forward_mode(1))
    began = session.state
    expected = jax.device_get(jax.tree.map(jnp.copy, began))  # no host view of `began`'s buffers
    batch, mode = session.put_batch(next(loader)), session.forward_mode(2)
    loader.close()
    stepped, metrics = session._step(jax.tree.map(jnp.copy, began), batch, mode)
    due = session.prepare_save(1, loader)
    copied_metrics = session.step_on_devices(batch, mode, copy_state=True)
    copied = session.take_state_copy(due)
    assert tree_equal(jax.device_get(copied.state), expected)
    assert all(jax.device_get(jax.tree.leaves(copied.finite)))
    assert {x.is_deleted() for x in jax.tree.leaves(began) if isinstance(x, jax.Array)} == {True}
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9),
                 jax.device_get(session.state), jax.device_get(stepped))  # fmt: skip
    for name, value in jax.device_get(metrics).items():
        np.testing.assert_allclose(jax.device_get(copied_metrics[name]), value, rtol=1e-5)

    def held(compiled) -> int:  # bytes a program holds at its peak, donated inputs reused
        m = compiled.memory_analysis()
        return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                + m.temp_size_in_bytes)  # fmt: skip

    state_bytes = sum(x.nbytes for x in jax.tree.leaves(session.state))
    gradients = held(session._gradients.lower(session.state, batch, mode).compile())
    step = held(session._step.lower(session.state, batch, mode).compile())
    assert gradients < step + state_bytes / 2, (gradients, step, state_bytes)


def test_a_steps_mode_says_whether_its_batch_holds_few_documents():
    """`ForwardMode.few_documents` comes from each host batch on a GPU: set where no row holds
    more runs of segment ids than the kernels take without a fallback (`documents_bound`); the
    first batch of more is reported once. Elsewhere the mode is left as it is."""
    run = tiny_run()
    lines = []
    session = TrainingSession(functional(run.model), run, None, report=lines.append)
    loader = make_loader(run)
    batch = next(loader)
    loader.close()
    seq = batch.segment_ids.shape[1]
    assert documents_bound(seq, run.model.msa.block_size) < seq  # a row can hold more
    one_each = batch._replace(segment_ids=np.ones_like(batch.segment_ids))
    alternating = batch._replace(segment_ids=1 + np.arange(seq) % 2 + 0 * batch.segment_ids)
    mode = session.forward_mode(1)
    assert session.mode_for(one_each, mode) is mode  # a CPU: no GPU kernel fallbacks to leave out
    a_gpu = mock.Mock(platform="gpu", compute_capability="9.0", core_count=132)
    with target.ahead_of_time([a_gpu]):
        assert session.mode_for(one_each, mode) == dataclasses.replace(mode, few_documents=True)
        assert not session.mode_for(alternating, mode).few_documents  # seq runs a row
        assert not session.mode_for(alternating, mode).few_documents
    assert len(lines) == 1 and "more than" in lines[0] and "fallbacks (once)" in lines[0]


def checkpoint_item(run_dir, step, name):
    directory = run_dir / "checkpoints" / str(step) / name
    if name == "state":
        return ocp.StandardCheckpointer().restore(directory)
    return ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(directory)


def test_train_completed_run_is_not_retrained(tmp_path, capsys):
    run = tiny_run(train={"steps": 2})
    train(run, tmp_path / "run")
    before = read_metrics(tmp_path / "run" / "metrics.jsonl")
    summary = train(run, tmp_path / "run")
    assert summary["start_step"] == summary["end_step"] == 2
    assert read_metrics(tmp_path / "run" / "metrics.jsonl") == before


@pytest.mark.slow
def test_train_sigterm_saves_checkpoint_then_resumes(tmp_path):
    run = tiny_run(train={"steps": 400}, checkpoint={"every_steps": 1000})
    config = write_config(tmp_path, run)
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "pretrain.train",
        "--config",
        str(config),
        "--run-dir",
        str(run_dir),
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    process = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.time() + 120
    while not read_metrics(run_dir / "metrics.jsonl") and time.time() < deadline:
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, output
    steps = [int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(steps) == 1 and 1 <= steps[0] < 400, output
    assert f"checkpoint at step {steps[0]} saved, stopping" in output
    resumed = subprocess.run(
        command + ["train.steps=" + str(steps[0] + 2)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming at step {steps[0]}" in resumed.stdout


def test_train_corrupt_checkpoint_stops_without_overwriting(tmp_path, capsys):
    run = tiny_run(train={"steps": 3})
    train(run, tmp_path / "run")
    config = write_config(tmp_path, tiny_run(train={"steps": 6}))
    state_dir = tmp_path / "run" / "checkpoints" / "3" / "state"
    victims = sorted(p for p in state_dir.rglob("*") if p.is_file() and p.stat().st_size > 0)
    for path in victims:
        path.write_bytes(b"garbage")
    digest = hashlib.sha256(
        b"".join(p.read_bytes() for p in sorted((tmp_path / "run").rglob("*")) if p.is_file())
    ).hexdigest()
    code = main(["--config", str(config), "--run-dir", str(tmp_path / "run")])
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert (
        len(error) == 1 and "cannot restore checkpoint" in error[0] and "checkpoints/3" in error[0]
    )
    after = hashlib.sha256(
        b"".join(p.read_bytes() for p in sorted((tmp_path / "run").rglob("*")) if p.is_file())
    ).hexdigest()
    assert after == digest


@pytest.mark.parametrize(
    "source, message", [("missing.txt", "missing.txt"), ("empty.txt", "no text found")]
)
def test_train_bad_text_source_stops_with_one_line(tmp_path, capsys, source, message):
    (tmp_path / "empty.txt").write_text("")
    config = write_config(tmp_path, tiny_run(data={"source": str(tmp_path / source)}))
    code = main(["--config", str(config), "--run-dir", str(tmp_path / "run")])
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(error) == 1
    assert error[0].startswith("m3-train: error: data.source=") and message in error[0]


def test_train_refuses_a_run_dir_of_another_model(tmp_path, capsys):
    train(tiny_run(train={"steps": 1}), tmp_path / "run")
    config = write_config(tmp_path, tiny_run(model={"hidden_size": 64}))
    assert main(["--config", str(config), "--run-dir", str(tmp_path / "run")]) == 2
    assert "holds a run with model.hidden_size=32, not 64" in capsys.readouterr().err


@pytest.mark.slow
def test_train_with_expert_parallel_mesh_gives_the_same_losses(tmp_path, capsys):
    """m3-train on 4 fake devices: experts over mesh.expert=2 (the default padded exchange; the
    ragged one; padded with blocks too small for any step, so through its worst-case branch;
    capacity buffers large enough to drop nothing) reproduce the losses of plain data
    parallelism."""
    config = write_config(tmp_path, tiny_run(train={"steps": 3}))

    def losses(name, *overrides):
        assert main(["--config", str(config), "--run-dir", str(tmp_path / name), *overrides]) == 0
        return read_metrics(tmp_path / name / "metrics.jsonl")

    reference = losses("data4", "mesh.data=4")
    expert_parallel = losses("expert2", "mesh.data=2", "mesh.expert=2")
    assert "'expert': 2" in capsys.readouterr().out
    ragged = losses("ragged", "mesh.data=2", "mesh.expert=2", "model.moe.exchange=ragged")
    padded = losses(
        "padded", "mesh.data=2", "mesh.expert=2", "model.moe.exchange=padded",
        "model.moe.exchange_factor=0.5",  # half a fair share: some peer always gets more
    )  # fmt: skip
    capacity = losses(
        "capacity", "mesh.data=2", "mesh.expert=2", "model.moe.dispatch=capacity",
        "model.moe.capacity_factor=2.0",  # C = ⌈2 · 32·2 / 4⌉ = 32 = tokens per device
    )  # fmt: skip
    for records in (expert_parallel, ragged, padded, capacity):
        np.testing.assert_allclose(
            [r["loss"] for r in records], [r["loss"] for r in reference], rtol=2e-5
        )
    assert [r["moe_dropped_fraction"] for r in capacity] == [0.0, 0.0, 0.0]
    assert [r["moe_exchange_worst_case"] for r in padded] == [1.0, 1.0, 1.0]
    assert all(0.0 <= r["moe_exchange_worst_case"] <= 1.0 for r in expert_parallel)  # padded
    assert [r["moe_exchange_worst_case"] for r in ragged] == [0.0, 0.0, 0.0]  # no blocks


@pytest.mark.slow
def test_a_run_killed_on_one_mesh_resumes_on_another_with_the_same_losses(tmp_path):
    """Experts over 2 devices × the sequence over 2 (context parallelism), killed after the
    step-3 checkpoint, resumed on plain data parallelism over 4: the checkpoint is restored into
    the new mesh's shardings and steps 4-6 lose what the uninterrupted run lost."""
    config = write_config(tmp_path, tiny_run())
    mixed = ("mesh.data=1", "mesh.expert=2", "mesh.seq=2")

    def run(name, *overrides):
        assert main(["--config", str(config), "--run-dir", str(tmp_path / name), *overrides]) == 0
        return [r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl")]

    straight = run("straight", *mixed)
    run("moved", *mixed)
    shutil.rmtree(tmp_path / "moved" / "checkpoints" / "6")
    moved = run("moved", "mesh.data=4")
    assert len(moved) == len(straight) == 6
    np.testing.assert_allclose(moved, straight, rtol=2e-5)
