"""Async saves of a device copy of the state (pretrain/state_copy.py): Orbax's copy to the host runs
in a background thread while the steps after the save donate the live state, and the checkpoint
still holds the state of its step; a device without room, or `device_copy: false`, saves on the
caller's thread (the default: `device_copy` is opt-in); a failure in the background is raised by
`wait` as a one-line save error."""

import errno
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from m3jax import sharding
from pretrain import state_copy
from pretrain.checkpointing import Checkpoints, CheckpointSaveError
from pretrain.config import CheckpointConfig


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


# A step as in training: the state it is given is donated, so its buffers are gone once it ran
_step = jax.jit(lambda state: jax.tree.map(lambda x: x + 1, state), donate_argnums=0)


def _save_then_step(
    checkpoints: Checkpoints, state: dict, stepped: threading.Event | None = None
) -> tuple[dict, bool]:
    """Saves `state` at step 1, then runs donating steps on it (and sets `stepped`) and waits for
    the save; returns (the host values saved, whether the save ran in the background)."""
    # read from a twin: a host read of `state` itself would keep it from being donated on CPU
    expected = jax.device_get(_state())
    checkpoints.save(1, state, {"position": 1}, {"tokens_seen": 1})
    in_background = checkpoints.saving_in_background
    for _ in range(3):
        state = jax.block_until_ready(_step(state))
    if stepped is not None:
        stepped.set()
    checkpoints.wait()
    assert checkpoints.latest_step() == 1
    return expected, in_background


def _restored(checkpoints: Checkpoints, like: dict) -> dict:
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like
    )
    return checkpoints.restore(1, abstract)[0]


def _assert_equal(restored: dict, expected: dict) -> None:
    """Values, and on the devices of the target's shardings (host arrays were saved)."""
    like = _state()
    for x, y, z in zip(*map(jax.tree.leaves, (restored, expected, like)), strict=True):
        assert isinstance(x, jax.Array) and x.sharding == z.sharding
        np.testing.assert_array_equal(np.asarray(x), y)


def test_background_save_holds_the_state_of_its_step_while_later_steps_donate_it(
    tmp_path, monkeypatch
):
    stepped = threading.Event()
    checkpoints = Checkpoints(tmp_path, CheckpointConfig(device_copy=True))
    orbax_save = checkpoints._manager.save

    def after_the_steps(*args, **kwargs):  # the thread's save waits until the state is donated
        assert stepped.wait(timeout=60)
        return orbax_save(*args, **kwargs)

    monkeypatch.setattr(checkpoints._manager, "save", after_the_steps)
    expected, in_background = _save_then_step(checkpoints, _state(), stepped)
    assert in_background
    _assert_equal(_restored(checkpoints, _state()), expected)
    checkpoints.close()


@pytest.mark.parametrize("why", ["no room", "device_copy off", "sync save"])
def test_without_a_device_copy_the_save_runs_on_the_callers_thread(tmp_path, monkeypatch, why):
    config = CheckpointConfig(device_copy=why != "device_copy off", async_save=why != "sync save")
    if why == "no room":
        monkeypatch.setattr(state_copy.DeviceCopies, "has_room", lambda self, state: False)
    checkpoints = Checkpoints(tmp_path, config)
    expected, in_background = _save_then_step(checkpoints, _state())
    assert not in_background
    _assert_equal(_restored(checkpoints, _state()), expected)
    checkpoints.close()


def test_a_background_save_failure_is_raised_by_wait_and_leaves_no_checkpoint(tmp_path):
    checkpoints = Checkpoints(tmp_path, CheckpointConfig(device_copy=True))

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    checkpoints._manager.save = disk_full
    checkpoints.save(1, _state(), {"position": 1}, {"tokens_seen": 1})
    assert checkpoints.saving_in_background
    with pytest.raises(CheckpointSaveError, match=r"step 1 failed: .*No space left on device"):
        checkpoints.wait()
    assert checkpoints.wait() is None  # reported once
    assert checkpoints.all_steps() == []
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
    spare = math.ceil(state_copy.MARGIN * limit)
    fits = limit - needed - spare  # the highest peak that leaves room
    assert state_copy.DeviceCopies(_device_stats(limit, fits)).has_room(state)
    assert not state_copy.DeviceCopies(_device_stats(limit, fits + 1)).has_room(state)
    assert state_copy.DeviceCopies(lambda device: None).has_room(state)  # CPU: host memory


def test_a_copy_made_is_taken_off_the_peak_it_raised():
    state = _state()
    needed = sharding.bytes_per_device(state, jax.tree.map(lambda x: x.sharding, state))
    limit = 1 << 30
    peak = limit - needed - math.ceil(state_copy.MARGIN * limit)  # room for one copy, just
    stats = {"bytes_limit": limit, "peak_bytes_in_use": peak}
    copies = state_copy.DeviceCopies(lambda device: stats)
    assert copies.has_room(state)
    copy = copies.copy(state)
    stats["peak_bytes_in_use"] += needed  # the next steps ran beside the copy
    assert copies.has_room(state)  # the steps' own peak has not grown
    stats["peak_bytes_in_use"] += 1  # ... now it has
    assert not copies.has_room(state)
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(copy), strict=True):
        assert x.sharding == y.sharding
        for a, b in zip(x.addressable_shards, y.addressable_shards, strict=True):
            assert a.data.unsafe_buffer_pointer() != b.data.unsafe_buffer_pointer()  # new buffers
        np.testing.assert_array_equal(x, y)
