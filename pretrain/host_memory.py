"""This process's host memory: its resident size, now and at peak, for the checkpoint benchmark.

Host memory grows save after save (CPU, 64 arrays of 4 MB, 0.27 GB in all: resident 0.58 GB
before the first save, 1.25 GB after the fifth): glibc keeps what the save's threads free in
per-thread arenas. `malloc_trim(0)` after each save kept it flat, but in the full CPU test suite
the XLA compile of a later train step in the same process then segfaulted (twice, the same test;
not when run alone), so it is not called (benchmarks/RESULTS.md). Linux only: elsewhere the
readings are 0.
"""

import pathlib

_STATUS = pathlib.Path("/proc/self/status")


def resident_bytes() -> int:
    """VmRSS: what the process holds in RAM now (pinned host memory included)."""
    return _status_bytes("VmRSS:")


def peak_resident_bytes() -> int:
    """VmHWM: the most it held since it started or since `reset_peak`."""
    return _status_bytes("VmHWM:")


def reset_peak() -> None:
    """Starts a new VmHWM window (Linux: "5" to /proc/self/clear_refs)."""
    try:
        pathlib.Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _status_bytes(key: str) -> int:
    try:
        lines = _STATUS.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        if line.startswith(key):
            return int(line.split()[1]) * 1024  # reported in kB
    return 0
