"""The steps a client call yields (`r3store_client.calls`), and the type of a call.

A call is a generator of steps: `Send` one HTTP request (answered with its
`httpx.Response`), `Sleep` before a retry, `Work` on the CPU (answered with what it
returns). `Client` and `AsyncClient` are the two runners of these steps; the calls
(`calls` and the mixins it gathers) only yield them.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Send:
    """One HTTP request to the server (answered with its `httpx.Response`)."""

    method: str
    path: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Work:
    """CPU work (or the object store's blocking reads): answered with `fn(*args)`."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()


Step = Send | Sleep | Work
Call = Generator[Step, Any, T]
