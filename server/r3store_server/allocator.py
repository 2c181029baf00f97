"""The C allocator, tuned for a server whose requests allocate and free megabytes.

glibc's malloc gives the free memory at the top of a heap back to the kernel as soon as
a little of it is free (and makes up to eight arenas a core, one per thread that
allocates), so a put's buffers of a megabyte or more (the blob, its decompressed
streams, the checks' temporaries) are faulted in again, page by page, on the next
put. `tune` serves buffers of up to `MMAP_BYTES` from the heaps, keeps up to
`TRIM_BYTES` free at the top of a heap, grows a heap `TOP_PAD_BYTES` at a time and
holds at most `ARENAS` arenas, so what is kept stays bounded (docs/operations.md, "The
C allocator", has what it saves).

An operator's own `MALLOC_*` variables win: when any is set nothing is changed. Where
the C library is not glibc (no `mallopt`), nothing is changed either.
"""

from __future__ import annotations

import ctypes
import os

TRIM_BYTES = 64 << 20
TOP_PAD_BYTES = 16 << 20
ARENAS = 2
MMAP_BYTES = 32 << 20
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8  # <malloc.h>


def tune() -> bool:
    """Set the allocator's thresholds for this process; True when they were set."""
    if any(name.startswith("MALLOC_") for name in os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    wanted = (
        (_M_MMAP_THRESHOLD, MMAP_BYTES),
        (_M_TRIM_THRESHOLD, TRIM_BYTES),
        (_M_TOP_PAD, TOP_PAD_BYTES),
        (_M_ARENA_MAX, ARENAS),
    )
    return all(mallopt(option, value) == 1 for option, value in wanted)
