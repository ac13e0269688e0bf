"""Numerical faults: a poisoned batch changes nothing and is named, repeated ones stop the run
with a checkpoint of the last good state, NaN is never saved, loss spikes are reported."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from tiny import tiny_run

import pretrain.train
from data.text_loader import PackedTextLoader
from m3jax.model import functional
from pretrain.checkpointing import Checkpoints
from pretrain.config import RunError
from pretrain.data_loading import make_loader
from pretrain.faults import FaultMonitor, NonFiniteStateError, keep_finite
from pretrain.metrics import read_metrics
from pretrain.session import TrainingSession
from pretrain.train import train


def test_keep_finite_keeps_the_old_state_on_nan_loss_or_infinite_gradient():
    old = {"step": jnp.int32(4), "params": {"w": jnp.ones(3)}, "opt_state": (jnp.zeros(3),)}
    new = {"step": jnp.int32(5), "params": {"w": jnp.full(3, 2.0)}, "opt_state": (jnp.ones(3),)}
    for loss, grad_norm, expect_skip in [(1.0, 1.0, False), (jnp.nan, 1.0, True),
                                         (1.0, jnp.inf, True), (1.0, jnp.nan, True)]:  # fmt: skip
        kept, skipped = jax.jit(keep_finite)(old, new, jnp.float32(loss), jnp.float32(grad_norm))
        assert bool(skipped) == expect_skip
        assert int(kept["step"]) == 5  # the step advances with the data either way
        chosen = old if expect_skip else new
        np.testing.assert_array_equal(kept["params"]["w"], chosen["params"]["w"])
        np.testing.assert_array_equal(kept["opt_state"][0], chosen["opt_state"][0])


class _PoisonedLoader(PackedTextLoader):
    """The text loader, with NaN in the loss mask of chosen (1-based) batches."""

    poisoned: tuple[int, ...] = ()

    def __next__(self):
        batch = super().__next__()
        if self._rows_emitted // self.batch_size in self.poisoned:
            batch = batch._replace(loss_mask=np.full_like(batch.loss_mask, np.nan))
        return batch


def _state(run_dir, step):
    return ocp.StandardCheckpointer().restore(run_dir / "checkpoints" / str(step) / "state")


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("copy_in_step", [False, True])
def test_poisoned_batches_are_skipped_named_and_stop_the_run_when_repeated(
    tmp_path, monkeypatch, capsys, copy_in_step
):
    """Step 3's batch is poisoned (skipped, the run goes on), then 6 to 15: eleven skips within
    100 steps are more than the default max_skipped_steps=10, so the run stops at step 15 with a
    checkpoint of the last good state. Each checkpoint counts the steps skipped up to it, also
    where each save's state is copied by the step after it (saves at every step overlap)."""
    poisoned = (3, *range(6, 16))
    monkeypatch.setattr(_PoisonedLoader, "poisoned", poisoned)
    monkeypatch.setattr(pretrain.data_loading, "PackedTextLoader", _PoisonedLoader)
    checkpoint = {"every_steps": 1, "keep": 20, "copy_in_step": copy_in_step}
    run = tiny_run(train={"steps": 20}, checkpoint=checkpoint)
    with pytest.raises(RunError) as stopped:  # main went on with NaN to the end
        train(run, tmp_path / "run")
    assert "11 of the last 100 steps (up to step 15) had a non-finite loss or gradient" in str(
        stopped.value
    )
    assert "checkpoint at step 15 saved (the last good state)" in str(stopped.value)
    run_dir = tmp_path / "run"
    for step in range(1, 16):  # main saved NaN from step 3 on
        assert all(np.isfinite(x).all() for x in jax.tree.leaves(_state(run_dir, step))), step
    for collection in ("params", "opt_state", "buffers"):  # untouched by a skipped step
        _assert_same(_state(run_dir, 2)[collection], _state(run_dir, 3)[collection])
        _assert_same(_state(run_dir, 5)[collection], _state(run_dir, 15)[collection])
    embed = [_state(run_dir, step)["params"]["embed"] for step in (3, 4)]
    assert not np.array_equal(*embed)  # step 4 was a good one
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == list(range(1, 16))
    for step in range(1, 16):
        saved = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(
            run_dir / "checkpoints" / str(step) / "progress"
        )
        assert saved["skipped_steps"] == sum(p <= step for p in poisoned), step
    lines = [line for line in capsys.readouterr().out.splitlines() if "update skipped" in line]
    assert [int(line.split(":")[1].split()[1]) for line in lines] == list(poisoned)
    assert "batch: " in lines[0] and "/act-" in lines[0]  # the scenes in the poisoned batch
    records = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}
    assert [records[s]["skipped_steps"] for s in (2, 3, 5, 6, 15)] == [0, 1, 1, 2, 11]
    assert np.isfinite(records[4]["loss"])
    assert records[4]["lr"] == records[3]["lr"] > records[2]["lr"]  # the schedule waited a step


def test_a_non_finite_state_is_never_saved(tmp_path):
    run = tiny_run()
    session = TrainingSession(functional(run.model), run, Checkpoints(tmp_path, run.checkpoint))
    session.initialize()
    params = session.state["params"]
    session.state["params"] = {**params, "embed": params["embed"].at[0, 0].set(jnp.inf)}
    with pytest.raises(NonFiniteStateError, match=r"at step 1 holds NaN or infinity in 1 array"):
        session.save(1, loader=None, data_state={})
    session.checkpoints.wait()
    assert session.checkpoints.all_steps() == []


def test_a_non_finite_state_copied_by_a_step_is_never_saved(tmp_path):
    """checkpoint.copy_in_step: the copy comes with whether each leaf of the state it copied is
    finite; the save of a copy holding infinity is refused as the plain one."""
    run = tiny_run(checkpoint={"copy_in_step": True})
    session = TrainingSession(functional(run.model), run, Checkpoints(tmp_path, run.checkpoint))
    session.initialize()
    params = session.state["params"]
    session.state["params"] = {**params, "embed": params["embed"].at[0, 0].set(jnp.inf)}
    loader = make_loader(run)
    due = session.prepare_save(1, loader)
    session.step(next(loader), session.forward_mode(1), copy_state=True)
    copied = session.take_state_copy(due)
    with pytest.raises(NonFiniteStateError, match=r"at step 1 holds NaN or infinity in 1 array"):
        session.start_copied_save(copied)
    session.checkpoints.wait()
    assert session.checkpoints.all_steps() == []
    loader.close()


def _monitor(**train_fields):
    lines = []
    run = tiny_run(train=train_fields, logging={"loss_spike_zscore": 6.0})
    return FaultMonitor(run, lines.append), lines


def test_fault_monitor_reports_a_loss_spike_with_its_batch():
    monitor, lines = _monitor()
    rng = np.random.default_rng(0)
    for step, loss in enumerate(3.0 - 0.01 * np.arange(60) + rng.normal(0, 0.02, 60), start=1):
        monitor.observe(step, {"skipped": np.bool_(False), "loss": np.float32(loss)}, f"b{step}")
    assert lines == []  # falling, noisy loss: no spike
    monitor.observe(61, {"skipped": np.bool_(False), "loss": np.float32(9.0)}, "the bad batch")
    monitor.flush()
    assert len(lines) == 1
    assert lines[0].startswith("m3-train: warning: step 61: loss spike 9 (")
    assert lines[0].endswith("batch: the bad batch")
    assert monitor.stop_reason is None


def test_fault_monitor_counts_skips_within_the_window_only():
    monitor, _ = _monitor(max_skipped_steps=2, skipped_steps_window=5)
    for step in (1, 4, 7, 10, 13):  # never 3 within 5 steps
        monitor.observe(step, {"skipped": np.bool_(True), "loss": np.float32(np.nan)}, "b")
    monitor.flush()
    assert monitor.skipped_steps == 5 and monitor.stop_reason is None
    monitor.observe(14, {"skipped": np.bool_(True), "loss": np.float32(np.nan)}, "b")
    monitor.observe(15, {"skipped": np.bool_(True), "loss": np.float32(np.nan)}, "b")
    monitor.flush()
    assert monitor.stop_reason.startswith("3 of the last 5 steps (up to step 14)")


def test_summary_names_the_step_of_each_document_kinds_last_loss():
    """A kind of document missing from the last logging windows (NaN there) is reported with the
    step it was last seen at, not as if it were current."""
    history = [
        {"step": 1, "nll_text_docs": 5.0, "nll_video_docs": 6.0},
        {"step": 50, "nll_text_docs": 3.0, "nll_video_docs": float("nan")},
    ]
    assert pretrain.train._last_by_document(history) == {"text": (50, 3.0), "video": (1, 6.0)}
