"""This process's host memory: its resident size (now and at peak), and freed memory handed back.

A checkpoint save allocates its host copies and tensorstore's write buffers in many threads;
glibc keeps what they free in its per-thread arenas, so each save used to leave the process larger
(CPU, 64 arrays of 4 MB, 0.27 GB in all: resident 0.58 GB before the first save, 1.25 GB after
the fifth). `release_freed_memory` after each save keeps it flat (0.54 GB after every save; a trim
took 4-18 ms). Linux only: elsewhere the readings are 0 and the release does nothing.
"""

import ctypes
import ctypes.util
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


def release_freed_memory() -> None:
    """Returns the memory freed into glibc's arenas to the OS (malloc_trim)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _status_bytes(key: str) -> int:
    try:
        lines = _STATUS.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        if line.startswith(key):
            return int(line.split()[1]) * 1024  # reported in kB
    return 0


def _glibc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _glibc()
