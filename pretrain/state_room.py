"""Room on the devices for a second train state, which a threaded checkpoint save needs.

Orbax's async save returns only once the state is on the host: the next step would donate the
state's buffers. With `checkpoint.threaded_save` Orbax's save runs in a thread instead and the
step after it does not donate its input (pretrain/session.py), so the state of the saved step
stays on the devices, beside the state the steps go on with, until the host has it (0.9 s for
bench-h200's 47 GB against its 0.67 s step; benchmarks/RESULTS.md). That is a second state on
every device, so the save is threaded only where each device reports room for it beside the peak
its steps have reached.
"""

from collections.abc import Callable

import jax

from m3jax import sharding

# Left free beside the second state: the step's temporaries are placed around it (fragmentation)
MARGIN = 0.05  # of each device's memory limit


class SecondStates:
    """Decides where a second state fits: beside the peak each device's steps reach, plus MARGIN.
    Devices that report no memory figures (CPU: host memory) count as having room. A device's
    peak counter never goes down and, once a second state was held, includes it (it lives through
    the next step at least), so the largest one held is taken off the peak."""

    def __init__(self, memory_stats: Callable = lambda device: device.memory_stats()):
        self._memory_stats = memory_stats
        self._held = 0  # the largest second state held, in bytes a device

    def reserve(self, state) -> bool:
        """Whether every device has room for a second `state`; if so, counts it as held beside
        the steps' own from now on (in the peak counter once the next step ran)."""
        needed = sharding.bytes_per_device(state, jax.tree.map(lambda x: x.sharding, state))
        devices = {d for x in jax.tree.leaves(state) for d in x.sharding.addressable_devices}
        for device in devices:
            stats = self._memory_stats(device)
            if not stats or "bytes_limit" not in stats:
                continue
            limit = stats["bytes_limit"]
            steps_peak = stats.get("peak_bytes_in_use", 0) - self._held
            if limit - steps_peak - needed < MARGIN * limit:
                return False
        self._held = max(self._held, needed)
        return True


# A device's peak counter is the process's, so the states held beside it are the process's too
SECOND_STATES = SecondStates()
