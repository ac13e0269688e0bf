"""Threaded saves (`checkpoint.threaded_save`): Orbax's copy to the host runs in a background
thread while the steps go on, the step right after the save keeps its input (not donated) and
the checkpoint holds the state of its step. A device without room for a second state
(pretrain/state_room.py), `threaded_save: false` or a synchronous save saves on the caller's
thread (the default: opt-in); a failure in the background is raised by `wait` as a one-line
save error."""

import errno
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tiny import tiny_run

from m3jax import sharding
from m3jax.model import functional
from pretrain import state_room
from pretrain.checkpointing import Checkpoints, CheckpointSaveError
from pretrain.config import CheckpointConfig
from pretrain.data_loading import make_loader
from pretrain.session import TrainingSession


def _state() -> dict:
    """Leaves sharded over every device and replicated, as a train state's."""
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    keys = jax.random.split(jax.random.key(0), 3)
    state = {
        "params": {"w": jax.random.normal(keys[0], (256, 128)), "b": jnp.zeros(128)},
        "opt_state": {"mu": jax.random.normal(keys[1], (256, 128), jnp.bfloat16)},
        "step": jnp.asarray(7, jnp.int32),
    }
    shardings = jax.tree.map(lambda x: rows if x.ndim == 2 else replicated, state)
    return jax.device_put(state, shardings)


def _plus_one(state):
    return jax.tree.map(lambda x: x + 1, state)


# Steps as a session runs them: the state is donated, except to the step after a threaded save
_donating_step = jax.jit(_plus_one, donate_argnums=0)
_step_keeping_input = jax.jit(_plus_one)


def _orbax_save_after(checkpoints: Checkpoints, event: threading.Event, monkeypatch) -> None:
    """The background thread's Orbax save waits for `event` (set once later steps have run)."""
    orbax_save = checkpoints._manager.save

    def after_the_steps(*args, **kwargs):
        assert event.wait(timeout=120)
        return orbax_save(*args, **kwargs)

    monkeypatch.setattr(checkpoints._manager, "save", after_the_steps)


def _save_then_step(
    checkpoints: Checkpoints, state: dict, stepped: threading.Event | None = None
) -> tuple[dict, bool]:
    """Saves `state` at step 1, then runs steps on it as a session does (and sets `stepped`) and
    waits for the save; returns (the host values saved, whether the save ran in a thread)."""
    # read from a twin: a host read of `state` itself would keep it from being donated on CPU
    expected = jax.device_get(_state())
    checkpoints.save(1, state, {"position": 1}, {"tokens_seen": 1})
    in_thread = checkpoints.holds_saved_state
    state = jax.block_until_ready((_step_keeping_input if in_thread else _donating_step)(state))
    for _ in range(3):
        state = jax.block_until_ready(_donating_step(state))
    if stepped is not None:
        stepped.set()
    checkpoints.wait()
    assert checkpoints.latest_step() == 1 and not checkpoints.holds_saved_state
    return expected, in_thread


def _restored(checkpoints: Checkpoints, like: dict, step: int = 1) -> dict:
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like
    )
    return checkpoints.restore(step, abstract)[0]


def _assert_equal(restored: dict, expected: dict, like: dict) -> None:
    """Values, and on the devices of the target's shardings (host arrays were saved)."""
    for x, y, z in zip(*map(jax.tree.leaves, (restored, expected, like)), strict=True):
        assert isinstance(x, jax.Array) and x.sharding == z.sharding
        np.testing.assert_array_equal(np.asarray(x), y)


def test_threaded_save_holds_the_state_of_its_step_while_later_steps_run(tmp_path, monkeypatch):
    stepped = threading.Event()
    checkpoints = Checkpoints(tmp_path, CheckpointConfig(threaded_save=True))
    _orbax_save_after(checkpoints, stepped, monkeypatch)
    expected, in_thread = _save_then_step(checkpoints, _state(), stepped)
    assert in_thread
    _assert_equal(_restored(checkpoints, _state()), expected, _state())
    checkpoints.close()


def test_a_session_keeps_the_saved_state_from_the_next_step_only(tmp_path, monkeypatch):
    """The real train step: the step after a threaded save runs undonated, the ones after it
    donate again, and the checkpoint written while they ran holds the saved step's values."""
    run = tiny_run(checkpoint={"async_save": True, "threaded_save": True})
    checkpoints = Checkpoints(tmp_path, run.checkpoint)
    session = TrainingSession(functional(run.model), run, checkpoints)
    session.initialize()
    loader = make_loader(run)
    batch = session.put_batch(next(loader))
    mode = session.forward_mode(1)
    session.step_on_devices(batch, mode)
    expected = jax.device_get(session.state)
    stepped = threading.Event()
    _orbax_save_after(checkpoints, stepped, monkeypatch)
    session.save(1, loader=None, data_state={})
    assert checkpoints.holds_saved_state
    saved = session.state
    session.step_on_devices(batch, mode)  # the step right after the save
    after_save = session.state
    for _ in range(2):
        jax.block_until_ready(session.step_on_devices(batch, mode))
    assert not any(x.is_deleted() for x in jax.tree.leaves(saved))  # the thread still reads it
    assert all(x.is_deleted() for x in jax.tree.leaves(after_save))  # donated to the next step
    stepped.set()
    assert checkpoints.wait() == 1
    _assert_equal(_restored(checkpoints, session.state), expected, session.state)
    loader.close()
    checkpoints.close()


@pytest.mark.parametrize("why", ["no room", "threaded_save off", "sync save"])
def test_without_a_threaded_save_the_save_runs_on_the_callers_thread(tmp_path, monkeypatch, why):
    config = CheckpointConfig(
        threaded_save=why != "threaded_save off", async_save=why != "sync save"
    )
    if why == "no room":
        monkeypatch.setattr(state_room.SecondStates, "reserve", lambda self, state: False)
    checkpoints = Checkpoints(tmp_path, config)
    expected, in_thread = _save_then_step(checkpoints, _state())
    assert not in_thread
    _assert_equal(_restored(checkpoints, _state()), expected, _state())
    checkpoints.close()


def test_a_background_save_failure_is_raised_by_wait_and_leaves_no_checkpoint(tmp_path):
    checkpoints = Checkpoints(tmp_path, CheckpointConfig(threaded_save=True))

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    checkpoints._manager.save = disk_full
    checkpoints.save(1, _state(), {"position": 1}, {"tokens_seen": 1})
    assert checkpoints.holds_saved_state
    with pytest.raises(CheckpointSaveError, match=r"step 1 failed: .*No space left on device"):
        checkpoints.wait()
    assert checkpoints.wait() is None  # reported once
    assert checkpoints.all_steps() == [] and not checkpoints.holds_saved_state
    checkpoints.close()


def _device_stats(limit: int, peak: int):
    return lambda device: {"bytes_limit": limit, "peak_bytes_in_use": peak}


def test_room_is_a_second_state_beside_the_steps_peak_plus_the_margin():
    state = _state()
    needed = sharding.bytes_per_device(state, jax.tree.map(lambda x: x.sharding, state))
    sharded = sum(x.nbytes for x in jax.tree.leaves(state) if x.ndim == 2)
    replicated = sum(x.nbytes for x in jax.tree.leaves(state) if x.ndim < 2)
    assert needed == sharded // jax.device_count() + replicated
    limit = 1 << 30
    spare = math.ceil(state_room.MARGIN * limit)
    fits = limit - needed - spare  # the highest peak that leaves room
    assert state_room.SecondStates(_device_stats(limit, fits)).reserve(state)
    assert not state_room.SecondStates(_device_stats(limit, fits + 1)).reserve(state)
    assert state_room.SecondStates(lambda device: None).reserve(state)  # CPU: host memory


def test_a_second_state_held_is_taken_off_the_peak_it_raised():
    state = _state()
    needed = sharding.bytes_per_device(state, jax.tree.map(lambda x: x.sharding, state))
    limit = 1 << 30
    peak = limit - needed - math.ceil(state_room.MARGIN * limit)  # room for one more, just
    stats = {"bytes_limit": limit, "peak_bytes_in_use": peak}
    states = state_room.SecondStates(lambda device: stats)
    assert states.reserve(state)
    stats["peak_bytes_in_use"] += needed  # the next steps ran beside it
    assert states.reserve(state)  # the steps' own peak has not grown
    stats["peak_bytes_in_use"] += 1  # ... now it has
    assert not states.reserve(state)
