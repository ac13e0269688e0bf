"""Stop signals: honoured while the loader is busy (skipping data), a second SIGTERM changes
nothing, a second Ctrl-C aborts."""

import os
import signal
import threading
import time

import orbax.checkpoint as ocp
import pytest
from tiny import tiny_run

import pretrain.data_loading
from data.text_loader import PackedTextLoader
from pretrain.train import _StopOnSignal, train


class _StallingLoader(PackedTextLoader):
    """After two batches, busy for up to a minute (as when skipping through unusable data), with
    a SIGTERM arriving meanwhile."""

    def __next__(self):
        if self._rows_emitted < 2 * self.batch_size:
            return super().__next__()
        self._rows_emitted += 1  # mid-batch: the position is no longer the one to save
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.01)
        raise RuntimeError("the stop signal never interrupted the loader")


def test_sigterm_while_the_loader_is_busy_saves_the_position_before_the_batch(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(pretrain.data_loading, "PackedTextLoader", _StallingLoader)
    summary = train(tiny_run(), tmp_path / "run")
    assert summary["stopped_by_signal"] == signal.SIGTERM and summary["end_step"] == 2
    saved = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(
        tmp_path / "run" / "checkpoints" / "2" / "data"
    )
    assert saved["process_count"] == 1  # one process's position (pretrain/distributed.py)
    assert (
        saved["processes"][0]["rows_emitted"] == 2 * 4
    )  # two batches of 4 rows: exactly where step 3 starts


def test_a_second_sigterm_changes_nothing_and_a_second_ctrl_c_aborts():
    with _StopOnSignal() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # schedulers repeat SIGTERM: still saving
        except KeyboardInterrupt:
            pytest.fail("a second SIGTERM aborted the run without saving")
        assert stop.signum == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
