"""Direct puts of one client that go together (`put_lanes`): the waiting and carrying
on their own, step by step, then concurrent puts on a real server over SeaweedFS, from
threads and from asyncio, each answered with its own results, and a carried put that
the store refuses refused alone."""

from __future__ import annotations

import asyncio
import json
import pickle
import uuid
from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest

from helpers import SPEC, eventually, expected_ids, make_write
from http_helpers import KEYS, ServerProcess
from r3store.errors import Conflict
from r3store.protocol.models import PutItem
from r3store.testing.seaweedfs import SeaweedFS
from r3store_client import AsyncClient, Client
from r3store_client.put_lanes import CARRY_WRITES, Alone, Carried, Lanes, Lead, Waiting
from r3store_client.steps import Wait

# the lanes on their own


def _entry(name: str, digest: bytes | None = None, size: int = 10, count: int = 1) -> Waiting:
    writes = [make_write(f"{name}/{i}", tokens=4) for i in range(count)]
    return Waiting(writes, writes, digest, size)


def _step(turn: Generator[Wait, Any, Any]) -> Any:
    """The next thing a join does: a `Wait` (its futures), or what it returned."""
    try:
        return next(turn)
    except StopIteration as done:
        return done.value


def _items(entries: list[Waiting]) -> list[PutItem]:
    return [
        PutItem(trajectory_id=w.trajectory_id, start=0, created=True)
        for e in entries
        for w in e.writes
    ]


def test_a_put_that_waits_is_carried_by_the_first_to_get_a_lane() -> None:
    lanes = Lanes(1)
    a, b, c = _entry("a"), _entry("b", count=2), _entry("c")
    first = _step(lanes.join("ns", a, 1000))
    assert first == Lead([a])  # a free lane: it goes at once, alone
    joins = {e.writes[0].trajectory_id: lanes.join("ns", e, 1000) for e in (b, c)}
    waits = {name: _step(join) for name, join in joins.items()}
    assert all(isinstance(w, Wait) for w in waits.values())
    lanes.carried([a], _items([a]))
    lanes.release("ns")
    assert all(any(f.done() for f in w.futures) for w in waits.values())
    lead = _step(joins["b/0"])
    assert lead == Lead([b, c])  # b waited longest: it carries c
    assert [f.done() for f in _step(joins["c/0"]).futures] == [False]  # c awaits its answer
    mine = lanes.carried(lead.group, _items([b, c]))
    assert mine is not None
    assert [i.trajectory_id for i in mine] == ["b/0", "b/1"]
    carried = _step(joins["c/0"])
    assert isinstance(carried, Carried)
    assert [i.trajectory_id for i in carried.items] == ["c/0"]
    lanes.release("ns")
    d = _entry("d")
    assert _step(lanes.join("ns", d, 1000)) == Lead([d])


Join = Generator[Wait, Any, Any]


def _two_waiting() -> tuple[Lanes, Waiting, Join, Waiting, Join]:
    """One lane, taken by a put a; b and c waiting: the lanes, b and its join, c and
    its join."""
    lanes = Lanes(1)
    a, b, c = _entry("a"), _entry("b"), _entry("c")
    assert _step(lanes.join("ns", a, 1000)) == Lead([a])
    b_join, c_join = lanes.join("ns", b, 1000), lanes.join("ns", c, 1000)
    assert isinstance(_step(b_join), Wait)
    assert isinstance(_step(c_join), Wait)
    return lanes, b, b_join, c, c_join


def _carrying() -> tuple[Lanes, Lead, Waiting, Join]:
    """`_two_waiting`, then a done: b got the lane and carries c. The lanes, b's turn,
    c and c's join (waiting for its answer)."""
    lanes, b, b_join, c, c_join = _two_waiting()
    lanes.release("ns")
    lead = _step(b_join)
    assert lead == Lead([b, c])
    return lanes, lead, c, c_join


def test_puts_carried_by_a_put_that_failed_go_again_alone() -> None:
    lanes, lead, c, c_join = _carrying()
    assert isinstance(_step(c_join), Wait)
    assert lanes.carried(lead.group, None) is None
    assert _step(c_join) == Alone()
    # sent again, it takes a lane of its own and carries nobody
    solo, d = c.again_alone(), _entry("d")
    solo_join, d_join = lanes.join("ns", solo, 1000), lanes.join("ns", d, 1000)
    assert isinstance(_step(solo_join), Wait)
    assert isinstance(_step(d_join), Wait)
    lanes.release("ns")
    assert _step(solo_join) == Lead([solo])
    lanes.release("ns")
    assert _step(d_join) == Lead([d])


def test_a_carrier_answered_with_other_than_one_result_a_write_failed() -> None:
    lanes, lead, _c, c_join = _carrying()
    assert lanes.carried(lead.group, _items(lead.group[:1])) is None  # one for two writes
    assert _step(c_join) == Alone()


def test_only_puts_that_fit_together_are_carried() -> None:
    lanes = Lanes(1)
    assert isinstance(_step(lanes.join("ns", _entry("a"), 1000)), Lead)
    b = _entry("b", digest=b"d1", size=600)
    other_dictionary = _entry("c", digest=b"d2", size=10)
    too_large = _entry("d", digest=b"d1", size=500)
    fits = _entry("e", digest=b"d1", size=400)
    many = _entry("f", digest=b"d1", size=1, count=CARRY_WRITES)
    joins = [lanes.join("ns", e, 1000) for e in (b, other_dictionary, too_large, fits, many)]
    assert all(isinstance(_step(j), Wait) for j in joins)
    lanes.release("ns")
    assert _step(joins[0]) == Lead([b, fits])  # same dictionary, 1,000 bytes at most
    assert other_dictionary in _waiting(lanes)
    assert too_large in _waiting(lanes)
    assert many in _waiting(lanes)  # more writes than one put carries


def _waiting(lanes: Lanes) -> list[Waiting]:
    return lanes._namespaces["ns"].waiting


def test_a_put_given_up_while_waiting_is_carried_by_nobody() -> None:
    lanes, _b, b_join, c, c_join = _two_waiting()
    b_join.close()  # its caller was cancelled
    lanes.release("ns")
    assert _step(c_join) == Lead([c])
    lanes.release("ns")
    assert "ns" not in lanes._namespaces  # nothing kept of a namespace at rest
    d, e = _entry("d"), _entry("e")
    assert _step(lanes.join("ns", d, 1000)) == Lead([d])
    e_join = lanes.join("ns", e, 1000)
    assert isinstance(_step(e_join), Wait)
    lanes.release("ns")  # e is woken, then given up before it looks
    e_join.close()
    assert "ns" not in lanes._namespaces


def test_a_forked_process_starts_with_free_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    lanes = Lanes(1)
    assert isinstance(_step(lanes.join("ns", _entry("a"), 1000)), Lead)
    assert isinstance(_step(lanes.join("ns", _entry("b"), 1000)), Wait)
    monkeypatch.setattr("os.getpid", lambda: -1)  # as in a child forked meanwhile
    c = _entry("c")
    assert _step(lanes.join("ns", c, 1000)) == Lead([c])


def test_a_pickled_copy_starts_with_free_lanes() -> None:
    lanes = Lanes(1)
    assert isinstance(_step(lanes.join("ns", _entry("a"), 1000)), Lead)
    client = Client("http://127.0.0.1:9", put_lanes=1)
    client._lanes = lanes
    copy = pickle.loads(pickle.dumps(client))._lanes  # as a DataLoader worker gets it
    assert copy is not None
    assert copy.lanes == 1
    b = _entry("b")
    assert _step(copy.join("ns", b, 1000)) == Lead([b])
    assert isinstance(_step(lanes.join("ns", _entry("c"), 1000)), Wait)  # the original's


def test_puts_go_at_once_while_lanes_are_free() -> None:
    lanes = Lanes(2)
    assert isinstance(_step(lanes.join("ns", _entry("a"), 1000)), Lead)
    assert isinstance(_step(lanes.join("ns", _entry("b"), 1000)), Lead)
    assert isinstance(_step(lanes.join("ns", _entry("c"), 1000)), Wait)
    assert isinstance(_step(lanes.join("other", _entry("d"), 1000)), Lead)
    with pytest.raises(ValueError, match="put_lanes"):
        Lanes(0)


# concurrent puts on a real server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, seaweed: SeaweedFS) -> Iterator[ServerProcess]:
    process = ServerProcess(tmp_path_factory.mktemp("lanes"), seaweed)
    yield process
    process.stop()


def _namespace(server: ServerProcess) -> str:
    name = f"n{uuid.uuid4().hex[:10]}"
    with Client(server.url, api_key=KEYS["admin"]) as admin:
        admin.create_namespace(name, SPEC)
    return name


class _Commits:
    """The commits an HTTP client sent (direct commits, or uploads through the server):
    how many writes each carried, and the status it was answered with."""

    def __init__(self, direct: bool) -> None:
        self.ending = "/writes/commit" if direct else "/trajectories"
        self.sent: list[tuple[int, int]] = []

    def __call__(self, response: httpx.Response) -> None:
        request = response.request
        if request.url.path.endswith(self.ending):
            writes = len(json.loads(request.content)["segments"]) if "commit" in self.ending else 0
            self.sent.append((writes, response.status_code))

    async def seen(self, response: httpx.Response) -> None:
        self(response)


def _check_stored(server: ServerProcess, ns: str, names: list[str]) -> None:
    with Client(server.url, api_key=KEYS["reader"]) as reader:
        batch = reader.get_batch(ns, names)
    for name, item in zip(names, batch.items, strict=True):
        assert item is not None, name
        assert item.routes is not None, name
        assert np.array_equal(item.routes.to_topk(), expected_ids(make_write(name)))


def _held(client: Client | AsyncClient, ns: str) -> Lanes:
    """The client's lanes, its only lane of `ns` taken as a put under way takes it."""
    lanes = client._lanes
    assert lanes is not None
    held = _entry("held")
    assert _step(lanes.join(ns, held, 1000)) == Lead([held])
    return lanes


def _when_waiting(lanes: Lanes, ns: str, count: int) -> None:
    eventually(lambda: len(lanes._namespaces[ns].waiting) == count, f"{count} puts waiting")


@pytest.mark.s3
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "through-the-server"])
def test_puts_that_wait_go_in_one_commit_and_each_gets_its_own_results(
    server: ServerProcess, direct: bool
) -> None:
    ns = _namespace(server)
    names = [f"t{i}" for i in range(16)]
    commits = _Commits(direct)
    http = httpx.Client(base_url=server.url, timeout=60, event_hooks={"response": [commits]})
    with Client(
        server.url, api_key=KEYS["writer"], http=http, put_lanes=1, direct_writes=direct
    ) as client:
        client.put(ns, [make_write("first")])  # alone: nothing waits
        lanes = _held(client, ns)

        def put(name: str) -> tuple[str, Any]:
            (result,) = client.put(ns, [make_write(name)])
            return name, result

        with ThreadPoolExecutor(len(names)) as pool:
            answers = pool.map(put, names)
            _when_waiting(lanes, ns, len(names))
            lanes.release(ns)
            answered = list(answers)
    http.close()
    for name, result in answered:
        assert result.trajectory_id == name
        assert result.created
        assert result.ref is not None
        assert result.ref.trajectory_id == name
    assert len(commits.sent) == 2  # the first put's, then one for the sixteen
    if direct:
        assert commits.sent == [(1, 200), (16, 200)]
    _check_stored(server, ns, ["first", *names])


@pytest.mark.s3
def test_a_carried_put_the_server_refuses_is_refused_alone(server: ServerProcess) -> None:
    ns = _namespace(server)
    commits = _Commits(direct=True)
    http = httpx.Client(base_url=server.url, timeout=60, event_hooks={"response": [commits]})
    with Client(server.url, api_key=KEYS["writer"], http=http, put_lanes=1) as client:
        client.put(ns, [make_write("taken")])
        other = make_write("taken")
        clash = type(other)("taken", other.num_tokens, topk=np.asarray(other.topk)[::-1].copy())
        names = [f"u{i}" for i in range(15)]
        order = [*names[:7], "taken", *names[7:]]
        lanes = _held(client, ns)

        def put(name: str) -> object:
            try:
                return client.put(ns, [clash if name == "taken" else make_write(name)])[0]
            except Conflict as exc:
                return exc

        with ThreadPoolExecutor(len(order)) as pool:
            answers = pool.map(put, order)
            _when_waiting(lanes, ns, len(order))
            lanes.release(ns)
            answered = dict(zip(order, answers, strict=True))
    http.close()
    assert isinstance(answered.pop("taken"), Conflict)
    assert all(r.created for r in answered.values())  # type: ignore[attr-defined]
    # the group of sixteen refused whole, then each sent alone: only the clash refused
    assert commits.sent[:2] == [(1, 200), (16, 409)]
    assert sorted(commits.sent[2:]) == [(1, 200)] * 15 + [(1, 409)]
    _check_stored(server, ns, names)


@pytest.mark.s3
def test_async_puts_that_wait_go_in_one_commit(server: ServerProcess) -> None:
    ns = _namespace(server)
    names = [f"a{i}" for i in range(12)]
    commits = _Commits(direct=True)

    async def main() -> list[Any]:
        http = httpx.AsyncClient(
            base_url=server.url, timeout=60, event_hooks={"response": [commits.seen]}
        )
        async with AsyncClient(server.url, api_key=KEYS["writer"], http=http, put_lanes=1) as c:
            await c.put(ns, [make_write("first")])
            lanes = _held(c, ns)
            puts = asyncio.gather(*(c.put(ns, [make_write(n)]) for n in names))
            while len(lanes._namespaces[ns].waiting) < len(names):
                await asyncio.sleep(0.05)
            lanes.release(ns)
            answered = await puts
        await http.aclose()
        return [r for (r,) in answered]

    results = asyncio.run(main())
    assert [r.trajectory_id for r in results] == names
    assert commits.sent == [(1, 200), (12, 200)]
    _check_stored(server, ns, ["first", *names])
