"""Fuzzing the upload path of a real server process: valid Arrow bodies, mutated in
their buffers, offsets, lengths, types and metadata. Every body is refused with a clear
4xx that changes nothing, or stored exactly as sent; the process never dies.

`make bench` runs the same campaign for thousands of bodies and records the counts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from http_helpers import KEYS, ServerProcess
from r3store.testing.arrow_fuzz import FUZZ_SPEC, base_bodies, mutate
from r3store.testing.upload_fuzz import UploadJudge

T = TypeVar("T")
BODIES = [body for body, _writes in base_bodies()]


class DrawChooser:
    """A `Chooser` drawing from hypothesis, so failures shrink."""

    def __init__(self, data: st.DataObject) -> None:
        self.data = data

    def integer(self, low: int, high: int) -> int:
        if high < low:
            raise ValueError("empty range")
        return self.data.draw(st.integers(low, high))

    def choice(self, options: Sequence[T]) -> T:
        if not options:
            raise ValueError("nothing to choose from")
        return self.data.draw(st.sampled_from(options))


@pytest.fixture(scope="module")
def judge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UploadJudge]:
    server = ServerProcess(tmp_path_factory.mktemp("fuzz"), None)
    made = UploadJudge(server.url, KEYS["admin"], "fuzz", FUZZ_SPEC, server.process)
    try:
        spec = {"num_layers": 2, "num_experts": 16, "top_k": 2}
        r = made.http.post("/v1/namespaces", json={"name": "fuzz", "spec": spec})
        assert r.status_code == 201, r.text
        yield made
    finally:
        made.close()
        server.stop()


def test_base_bodies_are_accepted(judge: UploadJudge) -> None:
    for body in BODIES:
        assert judge.judge(body).kind == "accepted"


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_hostile_uploads(judge: UploadJudge, data: st.DataObject) -> None:
    name, body = mutate(BODIES, DrawChooser(data))
    verdict = judge.judge(body)
    assert verdict.ok, f"{name}: {verdict}"


def test_server_still_serves(judge: UploadJudge) -> None:
    assert judge.process.poll() is None
    assert judge.http.get("/readyz").status_code == 200
