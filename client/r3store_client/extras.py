"""Optional dependencies: a missing one is an error that says what to install."""

from __future__ import annotations


def missing(module: str, user: str, extra: str) -> ImportError:
    """The error for `user` importing `module` that is not installed:
    `raise missing("torch", __name__, "torch") from exc`."""
    return ImportError(
        f"{user} needs {module}, which is not installed: pip install 'r3store[{extra}]'"
    )
