"""The devices that kernels and dispatch are chosen for.

Normally this process's devices. `m3-plan --target h200` compiles the train step for GPUs this
machine does not have (XLA:GPU ahead of time, pretrain/gpu_target.py): under `ahead_of_time`
every backend choice (MSA and dense attention kernels, MoE grouped matmul, interpret mode, the
number of persistent programs per SM) is made for those devices instead, so the plan compiles
the program a GPU run would.
"""

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax

_AHEAD_OF_TIME: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "ahead_of_time_devices", default=None
)


def devices() -> list:
    """The target devices: `jax.devices()`, or those `ahead_of_time` names."""
    chosen = _AHEAD_OF_TIME.get()
    return jax.devices() if chosen is None else list(chosen)


def platform() -> str:
    """"gpu", "tpu" or "cpu": the target devices' platform (`jax.default_backend()` normally)."""
    return devices()[0].platform


@contextlib.contextmanager
def ahead_of_time(target_devices: Sequence) -> Iterator[None]:
    """Chooses kernels for `target_devices` (e.g. a `jax.experimental.topologies` description's
    devices) while compiling for them from this process."""
    token = _AHEAD_OF_TIME.set(tuple(target_devices))
    try:
        yield
    finally:
        _AHEAD_OF_TIME.reset(token)
