"""The token check of the replay paths (torch required): the tokens a batch gives its
routers against the token ids stored with the routes (`TokenCheck`, made where the
tensors are, read when the host needs it), `TokenMismatch` when they differ, and the
warnings said once when a check cannot be made (`TokensNotChecked`, `GateNotChecked`)."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from r3store_client.extras import missing

try:
    import torch
except ImportError as exc:
    raise missing("torch", __name__, "torch") from exc

from r3store.errors import InvalidRoutes
from r3store_client.tensors import Origin


class TokensNotChecked(UserWarning):
    """Routes without stored token ids: replay cannot check they belong to the batch."""


class GateNotChecked(UserWarning):
    """The routes' model is not one whose gate replay knows: the gate is not checked."""


class TokenMismatch(InvalidRoutes):
    """The batch replayed into does not hold the tokens stored with the routes."""


_warned: set[tuple[str, str | None]] = set()
_warned_lock = threading.Lock()


def warn_once(
    kind: str, origin: Origin, message: str, category: type[Warning] = TokensNotChecked
) -> None:
    """`message` as a warning of `category`, once per process for each kind of warning
    and namespace."""
    key = (kind, origin.namespace)
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(f"{origin.where}: {message}", category, stacklevel=4)


def warn_untokened(tokens: torch.Tensor | None, origin: Origin) -> None:
    """Say once per namespace that routes without token ids are replayed unchecked."""
    if tokens is not None and not origin.untokened:
        return
    if tokens is None:
        which = "the routes were stored without token ids"
    else:
        which = (
            f"{len(origin.untokened)} of the micro-batch's trajectories (e.g. "
            f"{origin.untokened[0]!r}) were stored without token ids for some tokens"
        )
    warn_once(
        "untokened",
        origin,
        f"{which}, so replay cannot check that the batch holds the tokens they were "
        "recorded for (the order and layout of the batch rest on the caller); store "
        "token ids with the routes (TrajectoryWrite(..., token_ids=...)) or pass "
        "check_tokens=False",
    )


Locate = Callable[[npt.NDArray[np.int64]], tuple[npt.NDArray[Any], npt.NDArray[Any]]]


class TokenCheck:
    """One comparison of the tokens a batch gives its routers (`got`) with the tokens
    stored with the routes for the same rows (`want`, -1 where none is expected:
    padding, no token id stored), both of one shape on one device (views welcome:
    element `n` row-major is router row `n`). It is made where the tensors are, three
    element-wise kernels and a reduction, and nothing waits for it: on a GPU its
    one-byte outcome is copied to the host behind them. `verify()` reads the outcome
    when the host needs it (before backward, at the end of a micro-batch), by then long
    computed, and raises `TokenMismatch` naming the first sequence of the micro-batch
    that differs (its trajectory) and its first differing token: `locate(rows)` gives
    the sequence and position of router rows. `hint` says what to look at in the
    message."""

    def __init__(
        self,
        want: torch.Tensor,
        got: torch.Tensor,
        origin: Origin,
        hint: str,
        locate: Locate,
    ) -> None:
        self.origin, self.hint, self._locate = origin, hint, locate
        self._want, self._got = want, got
        self._event: Any = None
        differs = ((got != want) & (want >= 0)).any()
        if differs.device.type == "cuda":
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(differs, non_blocking=True)
            differs, self._event = host, torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record()
        self._differs = differs

    def verify(self) -> None:
        if self._event is not None:
            self._event.synchronize()  # the comparison only, not the work queued after it
        if not bool(self._differs):
            return
        want = self._want.reshape(-1).cpu().numpy()  # a mismatch: the host may wait now
        got = self._got.reshape(-1).cpu().numpy()
        rows = np.flatnonzero((got != want) & (want >= 0))
        sequences, positions = self._locate(rows)
        first = int(np.lexsort((positions, sequences))[0])
        row, sequence, position = int(rows[first]), int(sequences[first]), int(positions[first])
        raise TokenMismatch(
            f"{self.origin.sequence(sequence)}: token {position} is {int(got[row])} in the "
            f"batch but {int(want[row])} in the routes stored in {self.origin.where}: the "
            f"batch's sequences are not the routes' (in another order?) or {self.hint}"
        )
