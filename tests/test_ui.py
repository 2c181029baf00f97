"""The status page at /ui: served by a real server process holding routes of two
sources and two policy versions, rendered by Debian's headless chromium; the DOM must
hold the heatmap counted from the routes sent and the agreement between the sources;
a screenshot is kept in test-artifacts/."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from browser import Browser
from http_helpers import KEYS, ServerProcess
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store.testing.synthetic import uniform_topk
from r3store_client import Client

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
SPEC = RouteSpec(num_layers=3, num_experts=16, top_k=2)
TOKENS = 40


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, dict]]:
    """A server holding engine routes at policy versions 0 and 1 and trainer routes
    (a third of the slots moved) for version 1; returns it and the routes sent."""
    tmp = tmp_path_factory.mktemp("ui")
    server = ServerProcess(tmp, None)
    rng = np.random.default_rng(5)
    sent: dict = {"engine": {}, "trainer": {}}
    try:
        with Client(server.url, api_key=KEYS["admin"]) as client:
            client.create_namespace("ns", SPEC)
            client.create_namespace("other", SPEC)
            for version in (0, 1):
                client.set_policy_version("ns", version)
                writes = []
                for i in range(3):
                    ids = uniform_topk(rng, TOKENS, 3, 16, 2)
                    sent["engine"][(version, i)] = ids
                    writes.append(
                        TrajectoryWrite(
                            f"v{version}/t{i}", TOKENS, topk=ids, policy_version=version
                        )
                    )
                client.put("ns", writes)
            trainer = []
            for i in range(3):
                ids = sent["engine"][(1, i)].copy()
                moved = rng.random(ids.shape[:2]) < 0.33
                ids[moved, 0] = np.where(ids[moved, 1] == 15, 0, ids[moved, 1] + 1)
                ids[moved, 0] = np.where(
                    ids[moved, 0] == ids[moved, 1], (ids[moved, 0] + 1) % 16, ids[moved, 0]
                )
                sent["trainer"][(1, i)] = ids
                trainer.append(TrajectoryWrite(f"v1/t{i}", TOKENS, topk=ids, source="trainer"))
            client.put("ns", trainer)
        yield server, sent
    finally:
        server.stop()


def load_of(routes: list[np.ndarray]) -> np.ndarray:
    out = np.zeros((SPEC.num_layers, SPEC.num_experts), np.int64)
    for ids in routes:
        for layer in range(SPEC.num_layers):
            out[layer] += np.bincount(ids[:, layer].ravel(), minlength=SPEC.num_experts)
    return out


def agreement_of(a: list[np.ndarray], b: list[np.ndarray]) -> list[float]:
    per_layer = []
    for layer in range(SPEC.num_layers):
        shared = sum(
            len(set(x[t, layer]) & set(y[t, layer]))
            for x, y in zip(a, b, strict=True)
            for t in range(TOKENS)
        )
        per_layer.append(shared / (len(a) * TOKENS * SPEC.top_k))
    return per_layer


def test_the_page_renders_the_routes_in_chromium(
    served: tuple[ServerProcess, dict], tmp_path: Path
) -> None:
    server, sent = served
    browser = Browser(tmp_path / "profile")
    try:
        browser.open(f"{server.url}/ui", {"X-API-Key": KEYS["reader"]})
        names = browser.evaluate(
            "[...document.querySelectorAll('table.namespaces td.name a')].map(a => a.textContent)"
        )
        assert names == ["ns", "other"]
        browser.screenshot(ARTIFACTS / "ui-overview.png")

        browser.open(f"{server.url}/ui/namespaces/ns", {"X-API-Key": KEYS["reader"]})
        maps = browser.evaluate(
            """[...document.querySelectorAll('svg.heatmap')].map(svg => ({
                source: svg.dataset.source, version: Number(svg.dataset.version),
                counts: [...svg.querySelectorAll('rect.cell')].map(r => [
                    Number(r.dataset.layer), Number(r.dataset.expert), Number(r.dataset.count),
                    r.getBoundingClientRect().width > 0])
            }))"""
        )
        drawn = {(m["source"], m["version"]): m["counts"] for m in maps}
        assert set(drawn) == {("engine", 0), ("engine", 1), ("trainer", 1)}
        for (source, version), cells in drawn.items():
            expected = load_of([ids for (v, _i), ids in sent[source].items() if v == version])
            got = np.zeros_like(expected)
            for layer, expert, count, visible in cells:
                assert visible
                got[layer, expert] = count
            assert len(cells) == SPEC.num_layers * SPEC.num_experts
            np.testing.assert_array_equal(got, expected)

        shown = browser.evaluate(
            """[...document.querySelectorAll('table.agreement span[data-layer]')]
                .map(s => Number(s.dataset.agreement))"""
        )
        expected = agreement_of(
            [sent["engine"][(1, i)] for i in range(3)], [sent["trainer"][(1, i)] for i in range(3)]
        )
        assert 0.5 < min(expected) < max(expected) < 1.0
        np.testing.assert_allclose(shown, expected, atol=1e-6)
        png = browser.screenshot(ARTIFACTS / "ui-namespace.png")
        assert png.startswith(b"\x89PNG")
        assert len(png) > 10_000
    finally:
        browser.close()


def test_the_page_takes_the_api_keys(served: tuple[ServerProcess, dict]) -> None:
    server, _ = served
    with httpx.Client(base_url=server.url) as http:
        refused = http.get("/ui")
        assert refused.status_code == 401
        assert "<form" in refused.text
        scoped = http.get("/ui", headers={"X-API-Key": KEYS["other"]})
        assert scoped.status_code == 200
        assert "/ui/namespaces/other" in scoped.text
        assert "/ui/namespaces/ns'" not in scoped.text
        assert (
            http.get("/ui/namespaces/ns", headers={"X-API-Key": KEYS["other"]}).status_code == 403
        )
        bad = http.post(
            "/ui/login",
            content="key=nope",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        assert bad.status_code == 401
        good = http.post(
            "/ui/login",
            content=f"key={KEYS['reader']}",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        assert good.status_code == 303
        assert good.headers["location"] == "/ui"
        cookie = good.headers["set-cookie"]
        assert "HttpOnly" in cookie
        assert "SameSite=strict" in cookie
        assert "Path=/ui" in cookie
        page = http.get("/ui", headers={"Cookie": f"r3store_key={KEYS['reader']}"})
        assert page.status_code == 200
        assert "/ui/namespaces/ns" in page.text
        # the API never takes the cookie
        api = http.get("/v1/namespaces", headers={"Cookie": f"r3store_key={KEYS['reader']}"})
        assert api.status_code == 401
