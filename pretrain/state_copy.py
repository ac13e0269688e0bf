"""A second copy of the train state on its own devices, for a checkpoint save off the step's path.

Orbax's async save returns only once the state is on the host: the next step donates the state's
buffers, so its device-to-host copy blocks the training loop (0.94 s for bench-h200's 47.6 GB,
1.5 of its steps; benchmarks/RESULTS.md). A copy on the devices costs one read and one write of
the state in device memory (tens of milliseconds on an H200) and is never donated, so the host
copy and the writes can run beside the following steps (pretrain/checkpointing.py). It holds a
second state on every device until the host has it, so it is taken only where each device reports
room for it beside the peak its steps have reached.
"""

from collections.abc import Callable

import jax

from m3jax import sharding

# Left free beside the copy: the step's temporaries are placed around it (allocator fragmentation)
MARGIN = 0.05  # of each device's memory limit


class DeviceCopies:
    """Makes copies of a state on its devices where each device has room for one beside the peak
    its steps reach (plus MARGIN). Devices that report no memory figures (CPU: host memory) count
    as having room. A device's peak counter never goes down and, once a copy was made there,
    includes it: a copy lives through the next step at least (its host copy takes longer than a
    step wherever the state is large enough to matter: 0.9 s against bench-h200's 0.67 s step),
    so the largest copy made is taken off the peak."""

    def __init__(self, memory_stats: Callable = lambda device: device.memory_stats()):
        self._memory_stats = memory_stats
        self._copied = 0  # the largest copy made, in bytes a device

    def has_room(self, state) -> bool:
        needed = sharding.bytes_per_device(state, _shardings(state))
        devices = {d for x in jax.tree.leaves(state) for d in x.sharding.addressable_devices}
        for device in devices:
            stats = self._memory_stats(device)
            if not stats or "bytes_limit" not in stats:
                continue
            limit = stats["bytes_limit"]
            steps_peak = stats.get("peak_bytes_in_use", 0) - self._copied
            if limit - steps_peak - needed < MARGIN * limit:
                return False
        return True

    def copy(self, state):
        """A copy of `state` in new buffers on the same devices and shardings (dispatched, not
        waited for)."""
        shardings = _shardings(state)
        self._copied = max(self._copied, sharding.bytes_per_device(state, shardings))
        return jax.device_put(state, shardings, may_alias=False)


def _shardings(state):
    return jax.tree.map(lambda x: x.sharding, state)


# A device's peak counter is the process's, so the copies taken off it are the process's too
DEVICE_COPIES = DeviceCopies()
