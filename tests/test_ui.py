"""The status page at /ui: served by a real server process holding routes of two
sources over four policy versions, rendered by Debian's headless chromium. The DOM
must hold the heatmaps counted from the routes sent, with their colour scale, axes and
counts on hover; the agreement between the sources, the drift and the load imbalance as
charts with axes, tick labels, titles and values on hover, equal to what the routes
sent give; and no Python `None`. Screenshots are kept in test-artifacts/."""

from __future__ import annotations

import html
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from browser import Browser
from http_helpers import KEYS, ServerProcess
from r3store.catalog_types import NamespaceInfo, NamespaceUsage
from r3store.engine.analytics import VersionAgreement, VersionDrift, VersionLoad
from r3store.leases import Checkpoint, Lease, LeaseState
from r3store.logic.stats import Overlap
from r3store.policy import NamespaceSettings
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store.testing.synthetic import skewed_topk
from r3store_client import Client
from r3store_server.ui_charts import axis, cell_size, int_ticks, shade, tick_label
from r3store_server.ui_render import (
    Activity,
    Consumption,
    NamespaceDetail,
    NamespaceRow,
    login_page,
    namespace_page,
    overview,
)

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
SPEC = RouteSpec(num_layers=4, num_experts=16, top_k=2)
TOKENS = 40
VERSIONS = (0, 1, 2, 3)
MOVED = {1: 0.1, 2: 0.25, 3: 0.4}  # the share of token-layers the trainer routes differently


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, dict]]:
    """A server holding engine routes at policy versions 0 to 3 and trainer routes for
    versions 1 to 3 (a growing share of their first slots moved); returns it and the
    routes sent."""
    tmp = tmp_path_factory.mktemp("ui")
    server = ServerProcess(tmp, None)
    rng = np.random.default_rng(5)
    sent: dict = {"engine": {}, "trainer": {}}
    try:
        with Client(server.url, api_key=KEYS["admin"]) as client:
            client.create_namespace("ns", SPEC)
            client.create_namespace("other", SPEC)
            for version in VERSIONS:
                client.set_policy_version("ns", version)
                writes = []
                for i in range(3):
                    ids = skewed_topk(rng, TOKENS, SPEC.num_layers, 16, 2, skew=1.0)
                    sent["engine"][(version, i)] = ids
                    writes.append(
                        TrajectoryWrite(
                            f"v{version}/t{i}", TOKENS, topk=ids, policy_version=version
                        )
                    )
                client.put("ns", writes)
                if version not in MOVED:
                    continue
                trainer = []
                for i in range(3):
                    ids = sent["engine"][(version, i)].copy()
                    moved = rng.random(ids.shape[:2]) < MOVED[version]
                    ids[moved, 0] = np.where(ids[moved, 1] == 15, 0, ids[moved, 1] + 1)
                    sent["trainer"][(version, i)] = ids
                    trainer.append(
                        TrajectoryWrite(
                            f"v{version}/t{i}",
                            TOKENS,
                            topk=ids,
                            source="trainer",
                            policy_version=version,
                        )
                    )
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


def version_load(sent: dict, source: str, version: int) -> np.ndarray:
    return load_of([ids for (v, _i), ids in sent[source].items() if v == version])


def agreement_of(a: list[np.ndarray], b: list[np.ndarray]) -> tuple[list[float], float]:
    """Per layer and over all layers: the share of chosen experts both hold."""
    shared = []
    for layer in range(SPEC.num_layers):
        shared.append(
            sum(
                len(set(x[t, layer]) & set(y[t, layer]))
                for x, y in zip(a, b, strict=True)
                for t in range(TOKENS)
            )
        )
    slots = len(a) * TOKENS * SPEC.top_k
    return [s / slots for s in shared], sum(shared) / (slots * SPEC.num_layers)


def jensen_shannon(p_counts: np.ndarray, q_counts: np.ndarray) -> float:
    p, q = p_counts / p_counts.sum(), q_counts / q_counts.sum()
    m = (p + q) / 2

    def kl(x: np.ndarray) -> float:
        held = x > 0
        return float(np.sum(x[held] * np.log2(x[held] / m[held])))

    return (kl(p) + kl(q)) / 2


def series_points(browser: Browser, chart: str) -> dict[str, list[list]]:
    """Per series of the chart: [version, value, hover text] of each point."""
    found: dict[str, list[list]] = browser.evaluate(
        f"""(() => {{
            const out = {{}};
            for (const c of document.querySelectorAll('svg.{chart} circle.point')) {{
                const hover = c.querySelector('title').textContent;
                (out[c.dataset.series] ||= []).push(
                    [Number(c.dataset.x), Number(c.dataset.y), hover]);
            }}
            return out;
        }})()"""
    )
    return found


def chart_frame(browser: Browser, chart: str) -> dict:
    """A chart's title, axis labels and tick labels, and how many lines it draws."""
    frame: dict = browser.evaluate(
        f"""(() => {{
            const svg = document.querySelector('svg.{chart}');
            const texts = cls => [...svg.querySelectorAll('text.' + cls)].map(t => t.textContent);
            return {{title: texts('title')[0], x: texts('xlabel')[0], y: texts('ylabel')[0],
                     xticks: texts('xtick'), yticks: texts('ytick'),
                     lines: svg.querySelectorAll('polyline.line').length,
                     width: svg.getBoundingClientRect().width}};
        }})()"""
    )
    return frame


def test_signing_in_through_the_form(served: tuple[ServerProcess, dict], tmp_path: Path) -> None:
    """A browser with no key gets a form that asks for one and says where keys come
    from; the key typed in opens the page asked for."""
    server, _ = served
    browser = Browser(tmp_path / "profile")
    try:
        browser.open(f"{server.url}/ui/namespaces/ns", {})
        text = browser.evaluate("document.body.innerText")
        assert "Authorization" not in text
        assert "r3store keys create NAME --role reader" in text
        browser.screenshot(ARTIFACTS / "ui-login.png")
        browser.evaluate(
            f"""document.querySelector('input[name=key]').value = {KEYS["reader"]!r};
                document.querySelector('form').submit()"""
        )
        browser.wait_for(
            "location.pathname === '/ui/namespaces/ns' && document.readyState === 'complete'"
            " && document.querySelector('h1').textContent === 'ns'"
        )
    finally:
        browser.close()


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
        assert "None" not in browser.evaluate("document.body.innerText")
        browser.screenshot(ARTIFACTS / "ui-overview.png")

        browser.open(f"{server.url}/ui/namespaces/ns", {"X-API-Key": KEYS["reader"]})
        text = browser.evaluate("document.body.innerText")
        assert "None" not in text
        assert "Jensen-Shannon divergence" in text

        # heatmaps: the counts sent, cells big enough to see, axes, a count on hover
        maps = browser.evaluate(
            """[...document.querySelectorAll('svg.heatmap')].map(svg => ({
                source: svg.dataset.source, version: Number(svg.dataset.version),
                x: svg.querySelector('text.xlabel').textContent,
                y: svg.querySelector('text.ylabel').textContent,
                xticks: [...svg.querySelectorAll('text.xtick')].map(t => t.textContent),
                yticks: [...svg.querySelectorAll('text.ytick')].map(t => t.textContent),
                cells: [...svg.querySelectorAll('g.row')].flatMap(g =>
                    [...g.querySelectorAll('rect')].map((r, expert) => {
                        const box = r.getBoundingClientRect();
                        return [Number(g.dataset.layer), expert, Number(r.dataset.count),
                                box.width, box.height, r.querySelector('title').textContent,
                                r.getAttribute('fill')];
                    }))
            }))"""
        )
        drawn = {(m["source"], m["version"]): m for m in maps}
        assert set(drawn) == {("engine", v) for v in VERSIONS} | {("trainer", v) for v in MOVED}
        scale = browser.evaluate(
            """(() => { const s = document.querySelector('svg.colour-scale');
                return {top: Number(s.dataset.top),
                        ticks: [...s.querySelectorAll('text.tick')].map(t => t.textContent),
                        text: s.closest('figure').textContent}; })()"""
        )
        largest = 0.0
        for source, version in drawn:
            load = version_load(sent, source, version)
            largest = max(largest, float(np.max(load.max(axis=1) * 16 / load.sum(axis=1))))
        assert largest <= scale["top"] < 2 * largest  # a power of two
        assert scale["ticks"][0] == "0"  # black: no load
        assert scale["ticks"][1] == f"1/{scale['top']:g}x"
        assert "1x" in scale["ticks"]
        assert scale["ticks"][-1] == f"{scale['top']:g}x"
        assert "load over its layer's mean, on a log scale" in scale["text"]
        for (source, version), m in drawn.items():
            assert (m["x"], m["y"]) == ("expert", "layer")
            assert m["xticks"][0] == "0"
            assert m["yticks"][0] == "0"
            assert m["yticks"][-1] == str(SPEC.num_layers - 1)
            expected = version_load(sent, source, version)
            got = np.zeros_like(expected)
            for layer, expert, count, width, height, hover, fill in m["cells"]:
                assert width >= 12
                assert height >= 12
                mean = expected[layer].sum() / SPEC.num_experts
                assert hover == (
                    f"layer {layer}, expert {expert}: {count} token-layers "
                    f"({count / mean:.2f}x the mean)"
                )
                assert fill == shade(count / mean, scale["top"])
                got[layer, expert] = count
            assert len(m["cells"]) == SPEC.num_layers * SPEC.num_experts
            np.testing.assert_array_equal(got, expected)

        # agreement: the table per layer and the chart over versions
        shown = browser.evaluate(
            """[...document.querySelectorAll('table.agreement tr')].slice(1).map(tr =>
                [...tr.querySelectorAll('span[data-layer]')]
                    .map(s => Number(s.dataset.agreement)))"""
        )
        expected_layers, expected_all = {}, {}
        for version in MOVED:
            a = [sent["engine"][(version, i)] for i in range(3)]
            b = [sent["trainer"][(version, i)] for i in range(3)]
            expected_layers[version], expected_all[version] = agreement_of(a, b)
        np.testing.assert_allclose(shown, [expected_layers[v] for v in MOVED], atol=1e-6)
        assert expected_all[1] > expected_all[2] > expected_all[3] > 0.5
        frame = chart_frame(browser, "agreement-chart")
        assert frame["title"] == "Agreement between route sources over policy versions"
        assert frame["x"] == "policy version"
        assert frame["y"] == "experts both sources chose"
        assert frame["xticks"] == ["1", "2", "3"]
        assert all(t.endswith("%") for t in frame["yticks"])
        assert len(frame["yticks"]) >= 3
        assert frame["lines"] == 2  # all layers, lowest layer
        points = series_points(browser, "agreement-chart")
        overall = points["engine vs trainer, all layers"]
        assert [p[0] for p in overall] == list(MOVED)
        np.testing.assert_allclose([p[1] for p in overall], list(expected_all.values()), atol=1e-5)
        for version, value, hover in overall:
            assert hover.startswith(f"engine vs trainer, policy version {version}: ")
            assert f"{100 * value:.1f}%" in hover
        lowest = points["engine vs trainer, lowest layer"]
        np.testing.assert_allclose(
            [p[1] for p in lowest], [min(expected_layers[v]) for v in MOVED], atol=1e-5
        )

        # drift: Jensen-Shannon divergence between consecutive versions, per layer
        frame = chart_frame(browser, "drift-chart")
        assert "Jensen-Shannon" in frame["title"]
        assert frame["x"] == "policy version (from the one before)"
        assert frame["y"] == "JS divergence (base 2)"
        assert frame["yticks"][0] == "0"
        points = series_points(browser, "drift-chart")
        per_layer = {
            after: [
                jensen_shannon(
                    version_load(sent, "engine", after - 1)[layer],
                    version_load(sent, "engine", after)[layer],
                )
                for layer in range(SPEC.num_layers)
            ]
            for after in VERSIONS[1:]
        }
        mean = points["engine, mean over layers"]
        assert [p[0] for p in mean] == list(VERSIONS[1:])
        np.testing.assert_allclose(
            [p[1] for p in mean], [np.mean(per_layer[v]) for v in VERSIONS[1:]], atol=1e-5
        )
        assert mean[0][2].startswith("engine routes, policy version 0 → 1: mean over layers")
        most = points["engine, most drifting layer"]
        np.testing.assert_allclose(
            [p[1] for p in most], [max(per_layer[v]) for v in VERSIONS[1:]], atol=1e-5
        )
        assert "trainer, mean over layers" in points  # trainer routes: versions 1 to 3

        # load imbalance: the latest version's busiest expert over the mean, per layer
        bars = browser.evaluate(
            """[...document.querySelectorAll('svg.imbalance-chart.engine rect.bar')].map(r =>
                [Number(r.dataset.label), Number(r.dataset.value),
                 r.querySelector('title').textContent, r.getBoundingClientRect().height])"""
        )
        latest = version_load(sent, "engine", VERSIONS[-1])
        imbalance = latest.max(axis=1) * SPEC.num_experts / latest.sum(axis=1)
        assert [b[0] for b in bars] == list(range(SPEC.num_layers))
        np.testing.assert_allclose([b[1] for b in bars], imbalance, atol=1e-5)
        for layer, value, hover, height in bars:
            assert height > 0
            assert hover.startswith(f"layer {layer}: busiest expert {int(latest[layer].argmax())}")
            assert f"{value:.2f}x" in hover
        frame = chart_frame(browser, "imbalance-chart.engine")
        assert frame["title"] == (
            f"Load imbalance per layer: engine routes, policy version {VERSIONS[-1]}"
        )
        assert (frame["x"], frame["y"]) == ("layer", "busiest expert / mean")
        assert frame["xticks"] == [str(i) for i in range(SPEC.num_layers)]
        assert frame["yticks"][0] == "0"
        assert frame["yticks"][-1].endswith("x")
        points = series_points(browser, "imbalance-versions-chart")
        assert [p[0] for p in points["engine, most imbalanced layer"]] == list(VERSIONS)

        png = browser.screenshot(ARTIFACTS / "ui-namespace.png")
        assert png.startswith(b"\x89PNG")
        assert len(png) > 10_000
    finally:
        browser.close()


def test_the_page_takes_the_api_keys(served: tuple[ServerProcess, dict]) -> None:
    server, _ = served
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    with httpx.Client(base_url=server.url) as http:
        refused = http.get("/ui")
        assert refused.status_code == 401
        assert "<form" in refused.text
        assert "Authorization" not in refused.text
        assert "r3store keys create NAME --role reader" in refused.text
        scoped = http.get("/ui", headers={"X-API-Key": KEYS["other"]})
        assert scoped.status_code == 200
        assert "/ui/namespaces/other" in scoped.text
        assert "/ui/namespaces/ns'" not in scoped.text
        forbidden = http.get("/ui/namespaces/ns", headers={"X-API-Key": KEYS["other"]})
        assert forbidden.status_code == 403
        assert "may not" in forbidden.text
        bad = http.post("/ui/login", content="key=nope", headers=form)
        assert bad.status_code == 401
        assert "does not know this API key" in bad.text
        good = http.post("/ui/login", content=f"key={KEYS['reader']}", headers=form)
        assert good.status_code == 303
        assert good.headers["location"] == "/ui"
        cookie = good.headers["set-cookie"]
        assert cookie.startswith("r3store_session=")
        assert "HttpOnly" in cookie
        assert "SameSite=strict" in cookie
        assert "Path=/ui" in cookie
        assert "Secure" not in cookie  # plain http
        session = good.cookies["r3store_session"]
        assert KEYS["reader"] not in session  # a signed session, not the key
        back = http.post(
            "/ui/login", content=f"key={KEYS['reader']}&then=/ui/namespaces/ns", headers=form
        )
        assert back.headers["location"] == "/ui/namespaces/ns"
        for elsewhere in ("https://example.com/", "//example.com/ui", "/ui/../v1/namespaces"):
            away = http.post(
                "/ui/login", data={"key": KEYS["reader"], "then": elsewhere}, headers=form
            )
            assert away.headers["location"] == "/ui"
        page = http.get("/ui", headers={"Cookie": f"r3store_session={session}"})
        assert page.status_code == 200
        assert "/ui/namespaces/ns" in page.text
        forged = session[:-4] + ("AAAA" if session[-4:] != "AAAA" else "BBBB")
        stale = http.get("/ui", headers={"Cookie": f"r3store_session={forged}"})
        assert stale.status_code == 401
        assert "session ended" in stale.text
        assert 'r3store_session=""' in stale.headers["set-cookie"]  # taken away
        old = http.get("/ui", headers={"Cookie": f"r3store_key={KEYS['reader']}"})
        assert old.status_code == 401  # the key itself in a cookie is not taken any more
        assert 'r3store_key=""' in old.headers["set-cookie"]
        reader = {"X-API-Key": KEYS["reader"]}
        zipped = http.get("/ui/namespaces/ns", headers=reader)  # httpx takes gzip
        assert zipped.headers["content-encoding"] == "gzip"
        assert "<svg" in zipped.text
        plain = http.get("/ui/namespaces/ns", headers={**reader, "Accept-Encoding": "identity"})
        assert "content-encoding" not in plain.headers
        assert plain.text == zipped.text
        assert int(zipped.headers["content-length"]) * 4 < len(plain.content)
        missing = http.get("/ui/namespaces/nothing-here", headers=reader)
        assert missing.status_code == 404
        assert "no namespace named nothing-here" in missing.text
        # the API never takes the cookie
        api = http.get("/v1/namespaces", headers={"Cookie": f"r3store_session={session}"})
        assert api.status_code == 401


def test_sign_in_and_out_only_from_the_servers_own_page(
    served: tuple[ServerProcess, dict],
) -> None:
    """Login CSRF: a form post that the browser says came from another site changes no
    cookie; the same from this server's page signs in (and out); over TLS (a proxy's
    X-Forwarded-Proto) the cookie is Secure."""
    server, _ = served
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    own = server.url
    body = f"key={KEYS['other']}"
    with httpx.Client(base_url=server.url) as http:
        for sent in (
            {"Origin": "https://attacker.example"},
            {"Origin": "null"},
            {"Origin": own.replace("127.0.0.1", "localhost")},
            {"Sec-Fetch-Site": "cross-site"},
            {"Sec-Fetch-Site": "same-site"},
            {"Referer": "https://attacker.example/page.html"},
        ):
            for path in ("/ui/login", "/ui/logout"):
                refused = http.post(path, content=body, headers={**form, **sent})
                assert refused.status_code == 403, (path, sent, refused.text)
                assert "set-cookie" not in refused.headers, (path, sent)
                assert "another site" in refused.text
        for sent in (
            {"Origin": own},
            {"Sec-Fetch-Site": "same-origin"},
            {"Referer": f"{own}/ui"},
            {"Origin": "https://r3store.example", "X-Forwarded-Host": "r3store.example"},
        ):
            signed = http.post("/ui/login", content=body, headers={**form, **sent})
            assert signed.status_code == 303, (sent, signed.text)
            assert signed.headers["set-cookie"].startswith("r3store_session="), sent
        session = signed.cookies["r3store_session"]
        out = http.post(
            "/ui/logout",
            headers={"Origin": own, "Cookie": f"r3store_session={session}"},
        )
        assert out.status_code == 303
        assert out.headers["location"] == "/ui"
        assert 'r3store_session=""' in out.headers["set-cookie"]
        tls = http.post("/ui/login", content=body, headers={**form, "X-Forwarded-Proto": "https"})
        assert tls.status_code == 303
        assert "Secure" in tls.headers["set-cookie"]


def test_another_site_cannot_sign_a_browser_in_with_its_key(
    served: tuple[ServerProcess, dict], tmp_path: Path
) -> None:
    """In chromium: signed in with one key, the browser opens another site's page that
    posts the status page's login form with that site's key; the browser's session stays
    its own. Signing out from the page ends it."""
    import http.server
    import threading

    from r3store.testing.service import free_port

    server, _ = served
    target = f"{server.url}/ui/login"
    attack = (
        f"<!doctype html><form method=post action='{target}'>"
        f"<input name=key value='{KEYS['other']}'></form>"
        "<script>document.forms[0].submit()</script>"
    ).encode()

    class Attacker(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(attack)))
            self.end_headers()
            self.wfile.write(attack)

        def log_message(self, *args: object) -> None:
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Attacker)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    browser = Browser(tmp_path / "profile")

    def session() -> list[dict]:
        found = browser.call("Network.getCookies", urls=[f"{server.url}/ui"])["cookies"]
        return [c for c in found if c["name"].startswith("r3store")]

    try:
        browser.open(f"{server.url}/ui", {})
        browser.evaluate(
            f"""document.querySelector('input[name=key]').value = {KEYS["reader"]!r};
                document.querySelector('form').submit()"""
        )
        browser.wait_for("document.querySelector('table.namespaces') !== null")
        [mine] = session()
        assert mine["name"] == "r3store_session"
        assert mine["httpOnly"]
        assert KEYS["reader"] not in mine["value"]
        # localhost and 127.0.0.1 are two sites to the browser
        browser.open(f"http://localhost:{site.server_address[1]}/", {})
        browser.wait_for("location.pathname === '/ui/login' && document.readyState === 'complete'")
        assert "another site" in browser.evaluate("document.body.innerText")
        assert session() == [mine]  # unchanged: not the attacker's key's
        browser.open(f"{server.url}/ui", {})
        names = browser.evaluate(
            "[...document.querySelectorAll('table.namespaces td.name a')].map(a => a.textContent)"
        )
        assert names == ["ns", "other"]  # still the reader's view, not the scoped key's
        browser.evaluate("document.querySelector('form.out').submit()")
        browser.wait_for(
            "location.pathname === '/ui' && document.querySelector('input[name=key]') !== null"
        )
        assert session() == []
    finally:
        browser.close()
        site.shutdown()
        site.server_close()


def cells(page: str, css: str) -> list[list[str]]:
    """The text of each row's cells of the page's `table.css` (headings first)."""
    [table] = re.findall(rf"<table class='{css}'>(.*?)</table>", page)
    rows = re.findall(r"<tr>(.*?)</tr>", table)
    return [
        [
            html.unescape(re.sub(r"<[^>]+>", "", c))
            for c in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row)
        ]
        for row in rows
    ]


def test_the_page_shows_checkpoints_and_open_leases(
    served: tuple[ServerProcess, dict],
) -> None:
    """A trainer's checkpoint and open lease on namespace `other`, as its page shows them
    (to the reader scoped to it): the epoch, the checkpoint's step, consumption number,
    policy version and time, the lease's id prefix, holder, size and expiry; the
    namespace's `keep_checkpoints`."""
    server, _ = served
    with Client(server.url, api_key=KEYS["admin"]) as admin:
        routes = np.tile(np.array([0, 1], np.int32), (8, SPEC.num_layers, 1))
        admin.put("other", [TrajectoryWrite(f"c{i}", 9, topk=routes) for i in range(4)])
    with Client(server.url, api_key=KEYS["trainer"]) as trainer:
        taken = trainer.lease("other", n=2)
        trainer.commit(taken)
        point = trainer.checkpoint("other", 7)
        held = trainer.lease("other", n=1, seconds=3600)
    try:
        with httpx.Client(base_url=server.url) as http:
            page = http.get("/ui/namespaces/other", headers={"X-API-Key": KEYS["other"]})
        assert page.status_code == 200
        facts = dict((row[0], row[1]) for row in cells(page.text, "facts")[1:])
        assert facts["epoch"] == "0"
        assert facts["checkpoints kept"] == "the newest 3"
        head, *rows = cells(page.text, "checkpoints")
        assert head == ["step", "consumed", "policy version", "epoch", "when"]
        [[step, consumed, version, epoch, when]] = rows
        assert (step, consumed, version, epoch) == ("7", "1", str(point.policy_version), "0")
        assert when.startswith(time.strftime("%Y-%m-%d", time.localtime(point.created_at)))
        head, *rows = cells(page.text, "leases")
        assert head == ["lease", "holder", "trajectories", "expires in"]
        [[prefix, holder, size, expires]] = rows
        assert (prefix, holder, size) == (held.lease_id[:8], "trainer", "1")
        assert re.fullmatch(r"59 min \d+ s|1 h", expires), expires
        assert f"title='{held.lease_id}'" in page.text
        assert "None" not in page.text
    finally:
        with Client(server.url, api_key=KEYS["trainer"]) as trainer:
            trainer.release(held)


def test_the_maintenance_table_counts_what_leases_kept() -> None:
    from r3store_server.ui_html import remaining

    assert [remaining(s) for s in (7505.5, 598.2, 45, 0.4, -3, 90000)] == [
        "2 h 5 min", "9 min 58 s", "45 s", "0 s", "0 s", "1 d 1 h"
    ]  # fmt: skip
    activity = Activity({"trajectories_dropped": 5, "trajectories_kept": 3, "leases_forgotten": 2})
    page = overview([], activity, "0")
    rows = dict((row[0], row[1]) for row in cells(page, "activity")[1:])
    assert rows["trajectories dropped by retention"] == "5"
    assert rows["trajectories retention kept for a lease or a checkpoint"] == "3"
    assert rows["closed leases forgotten"] == "2"


def test_names_are_escaped() -> None:
    """What a page shows of names and messages is HTML-escaped."""
    hostile = "<script>alert(1)</script>"
    spec = RouteSpec(num_layers=2, num_experts=4, top_k=1)
    info = NamespaceInfo(hostile, spec, 0.0, 1, NamespaceSettings())
    usage = NamespaceUsage(1, 1, 100, 10, 0, {0: 1, 1: 1})
    load = np.array([[3, 1, 0, 0], [0, 0, 0, 0]], np.int64)
    overlap = Overlap(np.array([2, 0], np.int64), np.array([4, 0], np.int64))
    lease = Lease(hostile, "ab" * 16, 0, LeaseState.OPEN, ("t",), 0.0, 60.0, holder=hostile)
    detail = NamespaceDetail(
        NamespaceRow(info, usage),
        {hostile: [VersionLoad(0, 4, load), VersionLoad(1, 4, load)]},
        {(hostile, "trainer"): [VersionAgreement(1, 1, 4, overlap)]},
        {hostile: [VersionDrift(0, 1, [0.0, None])]},
        Consumption(0, [Checkpoint(hostile, 1, 0, 0, 0, 0.0)], [lease], 0.0),
    )
    for page in (namespace_page(detail, 6), login_page(hostile, hostile)):
        assert "<script" not in page
        assert "&lt;script&gt;" in page
        assert "None" not in page


def test_chart_scales() -> None:
    assert cell_size(4, 16) == (20, 20)  # a small map: 320 x 80 px, not 96 x 24
    assert cell_size(48, 128) == (3, 4)
    assert cell_size(94, 384) == (2, 2)
    low, high, ticks = axis([0.83, 0.97], cap=1.0)
    assert low <= 0.83
    assert 0.97 <= high <= 1.0
    assert ticks[0] == low
    assert [tick_label(t, ticks[1] - ticks[0], "%") for t in ticks][-1] == f"{100 * high:.0f}%"
    low, high, ticks = axis([0.0123, 0.034], zero=True)
    assert low == 0
    assert high >= 0.034
    assert len(ticks) >= 3
    assert axis([1.0], zero=False)[0] < 1.0 < axis([1.0])[1]
    assert int_ticks(0, 3, 480, 30) == [0, 1, 2, 3]
    assert int_ticks(0, 127, 384, 28) == [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120]
    assert int_ticks(5, 5, 100) == [5]
    assert shade(0, 8) == "#111111"  # no load
    assert shade(1, 8) == "#ffffff"  # an even share
    assert shade(8, 8) == shade(100, 8) == "#b2182b"
    assert shade(1 / 8, 8) == shade(0.01, 8) == "#2166ac"
