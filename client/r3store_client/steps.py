"""The steps a client call yields (`r3store_client.calls`), and the type of a call.

A call is a generator of steps: `Send` one HTTP request (answered with its
`httpx.Response`), `Sleep` before a retry, `Wait` for another call (`put_lanes`),
`Work` on the CPU (answered with what it returns). `Client` and `AsyncClient` are the
two runners of these steps; the calls (`calls` and the mixins it gathers) only yield
them. A runner goes through a call's steps with `Stepper`; the rollout writers go
through a delivery's (`writer.Delivery`) alike.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")
S = TypeVar("S")


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
class Wait:
    """Wait until one of `futures` is done (answered with None)."""

    futures: tuple[Future[Any], ...]


@dataclass(frozen=True)
class Work:
    """CPU work (or the object store's blocking reads): answered with `fn(*args)`."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()


Step = Send | Sleep | Wait | Work
Call = Generator[Step, Any, T]


class Stepper(Generic[S, T]):
    """The steps of a generator, for a loop that carries them out: iterating gives each
    step; `answer` sends its outcome back in, `fail` throws its error in instead. Once
    the generator returns, the loop ends and `result` holds what it returned; an error
    the generator does not catch is raised out of the loop."""

    result: T

    def __init__(self, steps: Generator[S, Any, T]) -> None:
        self._steps = steps
        self._outcome: Any = None
        self._error: BaseException | None = None

    def __iter__(self) -> Iterator[S]:
        while True:
            error, self._error = self._error, None
            outcome, self._outcome = self._outcome, None
            try:
                step = self._steps.throw(error) if error is not None else self._steps.send(outcome)
            except StopIteration as done:
                self.result = done.value
                return
            yield step

    def answer(self, outcome: Any) -> None:
        self._outcome = outcome

    def fail(self, error: BaseException) -> None:
        self._error = error
