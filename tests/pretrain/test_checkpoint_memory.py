"""Host memory across checkpoint saves: several async saves of a 0.27 GB state in one process leave
the process no larger than before the first (issue 18: the third save of bench-h200's 47.6 GB state
was killed for host memory)."""

import pathlib

import jax

from pretrain.checkpointing import Checkpoints
from pretrain.config import CheckpointConfig

ARRAYS, ARRAY_BYTES = 64, 4 << 20  # below glibc's mmap threshold: freed into its arenas
SAVES = 5


def resident_bytes() -> int:
    """VmRSS: what this process holds in RAM now."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise AssertionError("no VmRSS in /proc/self/status")


def _state() -> dict:
    keys = jax.random.split(jax.random.key(0), ARRAYS)
    return {f"w{i}": jax.random.normal(key, (ARRAY_BYTES // 4,)) for i, key in enumerate(keys)}


def test_checkpoint_saves_do_not_grow_resident_memory(tmp_path):
    # a donated step as in training: the saved arrays are gone once the step after the save ran
    step = jax.jit(lambda state: jax.tree.map(lambda x: x * 1.0001, state), donate_argnums=0)
    state = jax.block_until_ready(step(_state()))
    checkpoints = Checkpoints(tmp_path, CheckpointConfig(keep=2))
    before = resident_bytes()
    after = []
    for at in range(1, SAVES + 1):
        checkpoints.save(at, state, {"position": at}, {"tokens_seen": at})
        while checkpoints.poll() is None:
            state = jax.block_until_ready(step(state))
        after.append(resident_bytes())
    checkpoints.close()
    # before the fix (no trim): +0.36, +0.63, +1.01, +1.15, +1.46 GB (with zstd), a growth of about
    # one state a save; with it the readings scatter around zero (-0.10 to +0.15 GB seen on 2 cores
    # as the step, the compiler and pytest allocate beside the saves), so the median is held to
    # half a state: a leak of a quarter state a save still fails it
    allowed = before + ARRAYS * ARRAY_BYTES // 2
    grown = [f"{(a - before) / 1e9:+.2f}" for a in after]
    middle = sorted(after)[SAVES // 2]
    assert middle <= allowed, f"resident memory after each save vs before (GB): {grown}"
