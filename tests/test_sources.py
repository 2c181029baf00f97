"""Route sources end to end: engine and trainer routes of a tiny HF MoE (with and
without perturbed routers) uploaded through a real server; the agreement, expert load
and drift it reports equal an independent count; PR2 predicted routes are what replay
runs when present. Then the engine's rules: what another source may annotate, one
source per read, retention, compaction, rebuild, and a catalog made before sources."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from helpers import make_write
from http_helpers import KEYS, ServerProcess
from r3store.engine import Engine
from r3store.engine.maintenance import MaintenanceOptions
from r3store.errors import Conflict, InvalidInput
from r3store.policy import NamespaceSettings, Retention
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store.storage.catalog import Catalog
from r3store.storage.store.local import LocalStore
from r3store.testing.seaweedfs import SeaweedFS
from r3store.testing.synthetic import uniform_topk
from r3store_client import Client
from r3store_client.replay import RouterReplay
from r3store_client.tensors import padded
from test_replay import chosen_by_routers, drift, run, tiny

BATCH, TOKENS = 4, 16


def overlap(a: np.ndarray, b: np.ndarray) -> list[float]:
    """Per layer: the mean fraction of the top-k both chose, `[T, L, K]` each."""
    k = a.shape[2]
    return [
        sum(len(set(a[t, layer]) & set(b[t, layer])) for t in range(a.shape[0])) / (a.shape[0] * k)
        for layer in range(a.shape[1])
    ]


def js(p: np.ndarray, q: np.ndarray) -> float:
    p, q = p / p.sum(), q / q.sum()
    m = (p + q) / 2
    kl = lambda x: sum(xi * np.log2(xi / mi) for xi, mi in zip(x, m, strict=False) if xi > 0)  # noqa: E731
    return float((kl(p) + kl(q)) / 2)


def test_agreement_load_drift_and_predicted_routes_through_the_service(
    seaweed: SeaweedFS, tmp_path: Path
) -> None:
    model = tiny("qwen3_moe")
    replayer = RouterReplay(model, check_tokens=False)  # routes stored without token ids
    tokens = torch.randint(0, 128, (BATCH, TOKENS), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), replayer.record() as recorded:
        run(model, tokens)
    engine_ids = recorded.ids.numpy()  # [B, T, L, K]
    with torch.no_grad(), replayer.record() as same:  # the trainer's routers, unchanged
        run(model, tokens)
    drift(replayer)
    with torch.no_grad(), replayer.record() as perturbed:  # ... and after a perturbation
        run(model, tokens)
    layers, k = engine_ids.shape[2], engine_ids.shape[3]
    spec = RouteSpec(num_layers=layers, num_experts=4, top_k=k)
    # trajectories 0, 1 at policy version 0 (trainer unchanged); 2, 3 at 1 (perturbed)
    trainer_ids = np.concatenate([same.ids.numpy()[:2], perturbed.ids.numpy()[2:]])
    version = [0, 0, 1, 1]

    server = ServerProcess(tmp_path, seaweed)
    try:
        with Client(server.url, api_key=KEYS["admin"]) as client:
            client.create_namespace("run", spec)
            for v in (0, 1):
                client.set_policy_version("run", v)
                client.put(
                    "run",
                    [
                        TrajectoryWrite(f"t{i}", TOKENS, topk=engine_ids[i], policy_version=v)
                        for i in range(BATCH)
                        if version[i] == v
                    ],
                )
            results = client.put(
                "run",
                [
                    TrajectoryWrite(f"t{i}", TOKENS, topk=trainer_ids[i], source="trainer")
                    for i in range(BATCH)
                ],
            )
            assert [(r.source, r.created) for r in results] == [("trainer", True)] * BATCH

            reported = {
                v.policy_version: v for v in client.agreement("run", "engine", "trainer").versions
            }
            assert reported[0].agreement == [1.0] * layers  # same routers: full agreement
            for v, members in ((0, [0, 1]), (1, [2, 3])):
                expected = overlap(
                    np.concatenate([engine_ids[i] for i in members]),
                    np.concatenate([trainer_ids[i] for i in members]),
                )
                assert reported[v].segments == 2
                np.testing.assert_allclose(reported[v].agreement, expected, rtol=1e-12)
            assert min(reported[1].agreement) < 1.0  # the perturbation moved some choices

            loads = {v.policy_version: np.array(v.load) for v in client.expert_load("run").versions}
            for v in (0, 1):
                chosen = np.concatenate([engine_ids[i] for i in range(BATCH) if version[i] == v])
                for layer in range(layers):
                    counted = np.bincount(chosen[:, layer].ravel(), minlength=4)
                    np.testing.assert_array_equal(loads[v][layer], counted)
            [step] = client.drift("run").steps
            assert (step.before, step.after) == (0, 1)
            expected_drift = [js(loads[0][layer], loads[1][layer]) for layer in range(layers)]
            np.testing.assert_allclose(step.divergence, expected_drift, atol=1e-12)

            per = client.trajectory_loads("run", ["t2", "nope"], source="trainer")
            assert per.missing == ["nope"]
            [t2] = per.trajectories
            assert t2.source == "trainer"
            for layer in range(layers):
                counted = np.bincount(trainer_ids[2][:, layer].ravel(), minlength=4)
                np.testing.assert_array_equal(t2.load[layer], counted)

            # PR2: predicted routes, when present, are what a read serves and replay runs
            rng = np.random.default_rng(0)
            predicted = uniform_topk(rng, TOKENS, layers, 4, k)
            client.put("run", [TrajectoryWrite("t3", TOKENS, topk=predicted, source="predicted")])
            batch = client.get_batch("run", ["t3", "t2"])
            assert [item.source for item in batch.items] == ["predicted", "engine"]
            engine_read = client.get_batch("run", ["t3"], source="engine").items[0]
            assert engine_read.source == "engine"
            np.testing.assert_array_equal(engine_read.routes.ids, np.sort(engine_ids[3], axis=-1))
            routes = padded(client.get_batch("run", ["t3"]), spec)
            seen, handles = chosen_by_routers(replayer)
            with torch.no_grad(), replayer.replay(routes):
                run(model, tokens[3:4])
            for handle in handles:
                handle.remove()
            for layer, chosen in enumerate(seen):
                got = np.sort(chosen.numpy().reshape(TOKENS, k), axis=-1)
                np.testing.assert_array_equal(got, np.sort(predicted[:, layer], axis=-1))
    finally:
        server.stop()


@pytest.fixture
def engine(tmp_path: Path) -> Any:
    made = Engine(LocalStore(tmp_path / "objects"), Catalog(f"sqlite:///{tmp_path / 'c.db'}"))
    made.namespaces.create("ns", RouteSpec(4, 64, 4))
    yield made
    made.close()


def test_what_another_source_may_annotate(engine: Engine) -> None:
    engine.put("ns", [make_write("t", tokens=20, policy_version=0)])
    other = make_write("x", tokens=20)
    with pytest.raises(InvalidInput, match="no engine segment"):  # nothing to annotate
        engine.put("ns", [TrajectoryWrite("u", 20, topk=other.topk, source="trainer")])
    with pytest.raises(InvalidInput, match="no engine segment"):  # other tokens
        engine.put("ns", [TrajectoryWrite("t", 19, topk=other.topk[:19], source="trainer")])
    with pytest.raises(InvalidInput, match="policy version 3"):
        engine.put(
            "ns", [TrajectoryWrite("t", 20, topk=other.topk, source="trainer", policy_version=3)]
        )
    with pytest.raises(InvalidInput, match="unknown route source"):
        engine.put("ns", [TrajectoryWrite("t", 20, topk=other.topk, source="oracle")])  # type: ignore[arg-type]
    [made] = engine.put("ns", [TrajectoryWrite("t", 20, topk=other.topk, source="trainer")])
    [again] = engine.put("ns", [TrajectoryWrite("t", 20, topk=other.topk, source="trainer")])
    assert (made.created, again.created) == (True, False)
    with pytest.raises(Conflict):
        engine.put(
            "ns", [TrajectoryWrite("t", 20, topk=make_write("y", tokens=20).topk, source="trainer")]
        )
    # engine and another source in one put: the engine segment is there to annotate
    both = [
        make_write("v", tokens=20),
        TrajectoryWrite("v", 20, topk=other.topk, source="predicted"),
    ]
    assert [r.source for r in engine.put("ns", both)] == ["engine", "predicted"]
    assert engine.namespaces.count("ns") == 2  # trajectories, not sources


def test_a_read_serves_one_source_whole(engine: Engine) -> None:
    first, second = make_write("t", tokens=20), make_write("t2", tokens=10)
    engine.put("ns", [first])
    engine.put("ns", [TrajectoryWrite("t", 10, topk=second.topk, start=20)])
    engine.put(
        "ns", [TrajectoryWrite("t", 20, topk=make_write("p", tokens=20).topk, source="predicted")]
    )
    # predicted covers the first segment only: the default read serves the engine routes
    [item] = engine.get_batch("ns", ["t"]).items
    assert item is not None
    assert item.source == "engine"
    assert item.num_tokens == 30
    assert engine.get_batch("ns", ["t"], source="predicted").missing == ["t"]
    engine.put(
        "ns",
        [
            TrajectoryWrite(
                "t", 10, topk=make_write("q", tokens=10).topk, source="predicted", start=20
            )
        ],
    )
    [item] = engine.get_batch("ns", ["t"]).items
    assert item is not None
    assert item.source == "predicted"
    assert item.num_tokens == 30
    settings = NamespaceSettings(read_sources=["trainer"])
    engine.namespaces.update_settings("ns", settings)
    assert engine.get_batch("ns", ["t"]).missing == ["t"]
    sampled = engine.sample("ns", 1)
    assert sampled.ids == ["t"]
    assert sampled.missing == ["t"]


def test_retention_compaction_and_rebuild_keep_sources_together(engine: Engine) -> None:
    for v in (0, 1):
        engine.namespaces.set_policy_version("ns", v)
        engine.put("ns", [make_write(f"e{v}", tokens=20, policy_version=v)])
        engine.put(
            "ns",
            [
                TrajectoryWrite(
                    f"e{v}", 20, topk=make_write(f"z{v}", tokens=20).topk, source="trainer"
                )
            ],
        )
    before = engine.analytics.agreement("ns", "engine", "trainer")
    loads = engine.analytics.loads("ns", "trainer")
    report = engine.upkeep.rebuild()
    assert report.trajectories == 4
    after = engine.analytics.agreement("ns", "engine", "trainer")
    assert [(a.policy_version, a.overlap.fraction) for a in after] == [
        (b.policy_version, b.overlap.fraction) for b in before
    ]
    rebuilt = engine.analytics.loads("ns", "trainer")
    assert [(v.policy_version, v.load.tolist()) for v in rebuilt] == [
        (v.policy_version, v.load.tolist()) for v in loads
    ]
    engine.namespaces.update_settings("ns", NamespaceSettings(retention=Retention(keep_versions=1)))
    maintenance = engine.upkeep.maintenance(MaintenanceOptions(grace_seconds=0, compact_below=1.01))
    maintenance.run()
    assert engine.get_batch("ns", ["e0"], source="trainer").missing == ["e0"]
    [kept] = engine.get_batch("ns", ["e1"], source="trainer").items
    assert kept is not None
    assert kept.source == "trainer"
    assert engine.upkeep.rebuild().trajectories == 2  # the dropped trajectory stays dropped


def test_a_catalog_made_before_sources_is_brought_up_to_date(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "objects")
    url = f"sqlite:///{tmp_path / 'c.db'}"
    with Engine(store, Catalog(url)) as engine:
        engine.namespaces.create("ns", RouteSpec(4, 64, 4))
        write = make_write("t", tokens=20)
        engine.put("ns", [write])
    with sqlite3.connect(tmp_path / "c.db") as db:  # the table as it was: no source column
        ddl = db.execute("SELECT sql FROM sqlite_master WHERE name = 'trajectories'").fetchone()[0]
        columns = [r[1] for r in db.execute("PRAGMA table_info(trajectories)") if r[1] != "source"]
        old = ddl.replace("\tsource VARCHAR(16) DEFAULT 'engine' NOT NULL, \n", "")
        old = old.replace("trajectory_id, source, start", "trajectory_id, start")
        assert "source" not in old
        db.execute("ALTER TABLE trajectories RENAME TO t_new")
        db.execute(old)
        db.execute(f"INSERT INTO trajectories SELECT {', '.join(columns)} FROM t_new")
        db.execute("DROP TABLE t_new")
        db.execute("DROP TABLE alembic_version")  # made before migrations, too
    with Engine(LocalStore(tmp_path / "objects"), Catalog(url)) as engine:
        [item] = engine.get_batch("ns", ["t"]).items
        assert item is not None
        assert item.source == "engine"
        engine.put(
            "ns", [TrajectoryWrite("t", 20, topk=make_write("o", tokens=20).topk, source="trainer")]
        )
        assert engine.get_batch("ns", ["t"], source="trainer").items[0] is not None
