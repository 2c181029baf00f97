"""The server's allocator settings (`r3store_server.allocator`), in a process of their
own: a buffer of megabytes comes from a heap that keeps it for the next request, not
from a mapping of its own given back to the kernel when it is freed; an operator's
`MALLOC_*` variables are left to win."""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = """
import ctypes
from r3store_server import allocator

class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
tuned = allocator.tune()
before = libc.mallinfo2().hblks  # blocks mapped on their own
held = bytearray(8 << 20)  # a put's buffers are a few MiB
print(tuned, libc.mallinfo2().hblks - before)
"""


def _child(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env={**clean, **env}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_buffers_of_megabytes_come_from_a_heap_once_tuned() -> None:
    assert _child() == "True 0"


def test_an_operators_malloc_variables_win() -> None:
    assert _child(MALLOC_ARENA_MAX="4") == "False 1"
