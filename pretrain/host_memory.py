"""Freed host memory handed back to the OS.

A checkpoint save allocates its host copies and tensorstore's write buffers in many threads;
glibc keeps what they free in its per-thread arenas, so each save used to leave the process larger
(CPU, 64 arrays of 4 MB, 0.27 GB in all: resident +0.36, +0.63, +1.01, +1.15, +1.46 GB after five
saves; on the H200 a host of 125 GiB ran out of memory on the third save of a 47.6 GB state).
`release_freed_memory` after each save keeps it flat (a trim took 4-18 ms on CPU). Where there
is no glibc it does nothing.
"""

import ctypes
import ctypes.util


def release_freed_memory() -> None:
    """Returns the memory freed into glibc's arenas to the OS (malloc_trim)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _glibc()
