"""docs/format.md and docs/api.md say what the code writes and answers: the digest recipe
recomputes real digests, the order stream decodes as described, and the documented shard
columns, catalog tables, manifest fields, health answers, namespace answers and settings
are exactly the code's, so neither can drift silently."""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
import zstandard

from r3store.engine import Engine
from r3store.policy import NamespaceSettings
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store.storage.catalog import Catalog, metadata
from r3store.storage.store import LocalStore
from r3store.testing.service import start_server, stop_server
from r3store.testing.synthetic import uniform_topk
from r3store_server.settings import S3Settings, Settings

ROOT = Path(__file__).parent.parent
FORMAT = ROOT / "docs" / "format.md"
API = ROOT / "docs" / "api.md"
DIGEST_BLOCK = "# verify a digest"


# ---- reading the markdown


def section(text: str, heading: str) -> str:
    """The text under `heading` (a whole heading line) up to the next heading of the same
    or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.splitlines()
    start = lines.index(heading) + 1
    end = next(
        (
            i
            for i in range(start, len(lines))
            if re.match(rf"#{{1,{level}}} ", lines[i])
            and not lines[i].startswith("#" * (level + 1))
        ),
        len(lines),
    )
    return "\n".join(lines[start:end])


def cells(line: str) -> list[str]:
    """The cells of one table row; a `|` inside backticks is text, not a border."""
    out, current, quoted = [], "", False
    for char in line.strip().strip("|"):
        if char == "`":
            quoted = not quoted
        if char == "|" and not quoted:
            out.append(current.strip())
            current = ""
        else:
            current += char
    out.append(current.strip())
    return out


def tables(text: str) -> list[list[list[str]]]:
    """Every table in `text`: its rows (the header first, no separator), as cells."""
    found: list[list[list[str]]] = []
    rows: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            if not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line.strip()):
                rows.append(cells(line))
        elif rows:
            found.append(rows)
            rows = []
    return found


def table(text: str, header: list[str]) -> list[list[str]]:
    """The body rows of the one table in `text` with this header."""
    [rows] = [t[1:] for t in tables(text) if t[0] == header]
    return rows


def code(cell: str) -> str:
    """The first backticked text of a cell."""
    found = re.search(r"`([^`]*)`", cell)
    assert found, cell
    return found.group(1)


def python_block(path: Path, first_line: str) -> str:
    blocks: list[str] = re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
    [block] = [b for b in blocks if b.startswith(first_line)]
    return block


# ---- shards written by a real engine


def _with_empty_slots(
    rng: np.random.Generator, ids: npt.NDArray[Any], per: int
) -> npt.NDArray[Any]:
    """`ids` with up to `per` slots of each token-layer made empty (-1), anywhere."""
    out = ids.astype(np.int32)
    holes = rng.integers(0, per + 1, out.shape[:2])
    for slot in range(per):
        position = rng.integers(0, out.shape[2], out.shape[:2])
        chosen = holes > slot
        out[chosen, position[chosen]] = -1
    return out


ORDERED = {  # namespace -> spec and the routes sent (kept to check the order stream)
    "ordered": (RouteSpec(4, 64, 6, ordered=True, allow_fewer=True), 40),
    "ordered-k12": (RouteSpec(2, 400, 12, ordered=True, allow_fewer=True), 30),
}


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Shards of every kind the codec writes: uint8 and uint16 ids, both transforms,
    counts, both order encodings, token ids, null and set groups, appended segments,
    routes of another source.
    Returns the object store's directory and the ordered namespaces' routes as sent."""
    root = tmp_path_factory.mktemp("stored")
    rng = np.random.default_rng(11)
    sent: dict[str, Any] = {}
    catalog = Catalog(f"sqlite:///{root / 'catalog.db'}")
    with Engine(LocalStore(root / "objects"), catalog) as engine:
        engine.namespaces.create("sets", RouteSpec(4, 128, 8))
        first = TrajectoryWrite(
            "a",
            50,
            topk=uniform_topk(rng, 49, 4, 128, 8),
            prompt_len=7,
            group_id="g/ü",
            policy_version=3,
            token_ids=rng.integers(0, 2**31 - 1, 50),
        )
        other = TrajectoryWrite("b", 9, topk=uniform_topk(rng, 9, 4, 128, 8))
        engine.put("sets", [first, other])
        appended = TrajectoryWrite(
            "a", 20, topk=uniform_topk(rng, 19, 4, 128, 8), start=50, policy_version=4
        )
        engine.put("sets", [appended])
        trainer = TrajectoryWrite("b", 9, topk=uniform_topk(rng, 9, 4, 128, 8), source="trainer")
        engine.put("sets", [trainer])

        engine.namespaces.create("recurring", RouteSpec(4, 256, 8))
        pool = uniform_topk(rng, 8, 1, 256, 8)[:, 0]  # few sets, recurring: stored sorted
        engine.put(
            "recurring", [TrajectoryWrite("r", 2000, topk=pool[rng.integers(0, 8, (2000, 4))])]
        )

        engine.namespaces.create("wide", RouteSpec(3, 300, 4, allow_fewer=True))
        wide = _with_empty_slots(rng, uniform_topk(rng, 59, 3, 300, 4), 4)
        engine.put("wide", [TrajectoryWrite("w", 60, topk=wide, token_ids=np.arange(60))])

        engine.namespaces.create("single", RouteSpec(2, 16, 1))
        engine.put("single", [TrajectoryWrite("s", 12, topk=uniform_topk(rng, 12, 2, 16, 1))])

        for name, (spec, tokens) in ORDERED.items():
            engine.namespaces.create(name, spec)
            ids = uniform_topk(rng, tokens - 1, spec.num_layers, spec.num_experts, spec.top_k)
            ids = _with_empty_slots(rng, ids, 3)
            engine.put(name, [TrajectoryWrite("o", tokens, topk=ids, group_id="o")])
            sent[name] = ids
    return root / "objects", sent


def shard_files(objects: Path, namespace: str = "*") -> list[Path]:
    return sorted(objects.glob(f"shards/{namespace}/*.parquet"))


def test_the_shards_cover_every_stream_kind(stored: tuple[Path, dict[str, Any]]) -> None:
    objects, _ = stored
    rows, specs = [], []
    for path in shard_files(objects):
        file = pq.ParquetFile(path)
        spec = RouteSpec.from_json(file.schema_arrow.metadata[b"r3store.route_spec"])
        specs.append(spec)
        rows += [(spec, row) for row in file.read().to_pylist()]
    assert {row["route_transform"] for _, row in rows} == {0, 1}
    assert any(spec.num_experts > 256 for spec in specs)
    assert any(row["route_counts"] is not None for _, row in rows)
    assert any(row["route_counts"] is None for _, row in rows)
    assert {spec.top_k <= 8 for spec, row in rows if row["route_order"] is not None} == {
        True,
        False,
    }
    assert any(row["token_ids"] is not None for _, row in rows)
    assert {row["group_id"] is None for _, row in rows} == {True, False}
    assert any(row["start"] > 0 for _, row in rows)


def test_digest_recipe_recomputes_every_stored_digest(
    stored: tuple[Path, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects, _ = stored
    block = python_block(FORMAT, DIGEST_BLOCK)
    checked = 0
    for i, path in enumerate(shard_files(objects)):
        where = tmp_path / str(i)
        where.mkdir()
        shutil.copy(path, where / "shard.parquet")
        monkeypatch.chdir(where)
        scope: dict[str, Any] = {}
        exec(compile(block, "format.md", "exec"), scope)
        stored_digests = pq.read_table(path).column("digest").to_pylist()
        assert scope["digests"] == stored_digests, path.name
        checked += len(stored_digests)
    assert checked == 9


def _digits(rank: int, k: int) -> list[int]:
    return [(rank // math.factorial(k - 1 - i)) % (k - i) for i in range(k)]


def test_order_stream_decodes_as_documented(stored: tuple[Path, dict[str, Any]]) -> None:
    """Little-endian uint16 Lehmer ranks (K <= 8) or uint8 positions (K > 8) of the
    producer's order; empty slots rank last."""
    objects, sent = stored
    for name, (spec, tokens) in ORDERED.items():
        [path] = shard_files(objects, name)
        [row] = pq.read_table(path).to_pylist()
        layers, k = spec.num_layers, spec.top_k
        unzstd = zstandard.ZstdDecompressor()
        dtype = np.dtype("<u2") if spec.num_experts > 256 else np.dtype("u1")
        size = layers * tokens * k * dtype.itemsize
        ids = np.frombuffer(
            unzstd.decompress(row["route_ids"], max_output_size=size), dtype
        ).reshape(layers, tokens, k)
        if row["route_transform"] == 1:
            gaps = ids.astype(np.int64)
            gaps[..., 1:] += 1
            ids = np.cumsum(gaps, axis=-1) % 2 ** (8 * dtype.itemsize)
        counts = np.frombuffer(
            unzstd.decompress(row["route_counts"], max_output_size=layers * tokens), np.uint8
        ).reshape(layers, tokens)
        raw = unzstd.decompress(row["route_order"], max_output_size=layers * tokens * k)
        if k <= 8:
            ranks = np.frombuffer(raw, "<u2").reshape(layers, tokens)
        else:
            positions = np.frombuffer(raw, np.uint8).reshape(layers, tokens, k)
        producer = np.asarray(sent[name])  # [T - 1, L, K], -1 in empty slots
        for layer in range(layers):
            for token in range(tokens):
                c = int(counts[layer, token])
                sorted_ids = [int(x) for x in ids[layer, token]]
                if k <= 8:
                    digits = _digits(int(ranks[layer, token]), k)
                    remaining = list(range(k))
                    order = [remaining.pop(d) for d in digits]
                    assert all(d == 0 for d in digits[c:])  # empty slots rank last
                else:
                    order = [int(p) for p in positions[layer, token]]
                    assert order[c:] == list(range(c, k))
                got = [sorted_ids[order[i]] for i in range(c)]
                if token == tokens - 1:  # never routed: no recorded route
                    assert c == 0
                    continue
                want = [int(x) for x in producer[token, layer] if x != -1]
                assert got == want, (name, layer, token)


# ---- what format.md's tables name


def test_shard_columns_and_metadata_are_documented(stored: tuple[Path, dict[str, Any]]) -> None:
    objects, _ = stored
    file = pq.ParquetFile(shard_files(objects)[0])
    shards = section(FORMAT.read_text(), "## Shards")
    documented = [
        (code(name), kind) for name, kind, _ in table(shards, ["column", "type", "meaning"])
    ]
    actual = [
        (f.name, str(f.type) + (", nullable" if f.nullable else "")) for f in file.schema_arrow
    ]
    assert documented == actual
    keys = [code(key) for key, _ in table(shards, ["key", "value"])]
    at_rest_only = "r3store.rest_level"  # tests/test_rest.py finds it in a shard at rest
    assert at_rest_only in keys
    written = [k.decode() for k in file.schema_arrow.metadata if k != b"ARROW:schema"]
    assert [k for k in keys if k != at_rest_only] == written


def _sa_type(column: sa.Column[Any]) -> str:
    kind = type(column.type).__name__
    length = getattr(column.type, "length", None)
    return kind + (f"({length})" if length else "") + (", nullable" if column.nullable else "")


def _columns(names: Any) -> str:
    names = [c.name for c in names]
    return f"`{names[0]}`" if len(names) == 1 else f"`({', '.join(names)})`"


def test_catalog_tables_are_documented() -> None:
    catalog = section(FORMAT.read_text(), "## Catalog")
    documented = re.findall(r"^### `(\w+)`$", catalog, flags=re.M)
    tables = dict(metadata.tables)
    assert sorted(documented) == sorted(tables)
    for name, sa_table in tables.items():
        text = section(catalog, f"### `{name}`")
        rows = table(text, ["column", "type", "meaning"])
        assert [(code(c), kind) for c, kind, _ in rows] == [
            (c.name, _sa_type(c)) for c in sa_table.columns
        ], name
        key = sa_table.primary_key.columns
        assert f"Primary key `({', '.join(c.name for c in key)})`" in text, name
        for index in sa_table.indexes:
            assert _columns(index.columns) in text.split("Primary key")[1].split("\n\n")[0], (
                name,
                index.name,
            )


def test_manifest_fields_are_documented(stored: tuple[Path, dict[str, Any]]) -> None:
    objects, _ = stored
    manifest = json.loads((objects / "namespaces" / "sets.json").read_text())
    text = section(FORMAT.read_text(), "## Namespace manifests")
    rows = table(text, ["field", "value"])
    assert [code(f) for f, _ in rows] == list(manifest)
    values = dict((code(f), v) for f, v in rows)
    assert set(re.findall(r'"(\w+)"', values["spec"])) == set(manifest["spec"])
    settings = manifest["settings"]
    nested = {*settings["retention"], *settings["leasing"]}
    assert set(re.findall(r'"(\w+)"', values["settings"])) == {*settings, *nested}
    assert settings == NamespaceSettings().model_dump(mode="json")


# ---- api.md against a real server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    process, url = start_server(tmp_path_factory.mktemp("server"))
    try:
        yield url
    finally:
        stop_server(process)


def _endpoint_answer(method_and_path: str) -> str:
    endpoints = section(API.read_text(), "## Endpoints")
    rows = table(endpoints, ["method and path", "role", "body", "answer"])
    [answer] = [row[3] for row in rows if code(row[0]) == method_and_path]
    return answer


def test_health_answers_are_documented(server: str) -> None:
    for path in ("/healthz", "/readyz"):
        answer = httpx.get(server + path, timeout=10)
        assert answer.status_code == 200
        assert answer.json() == json.loads(code(_endpoint_answer(f"GET {path}"))), path


def test_namespace_answers_are_documented(server: str) -> None:
    text = section(API.read_text(), "### The namespace")
    rows = dict((code(f), meaning) for f, meaning in table(text, ["field", "meaning"]))
    spec = {"num_layers": 2, "num_experts": 8, "top_k": 2}
    with httpx.Client(base_url=server, timeout=10) as client:
        answers = {
            "POST /v1/namespaces": client.post(
                "/v1/namespaces", json={"name": "run1", "spec": spec}
            ),
            "GET /v1/namespaces": client.get("/v1/namespaces"),
            "GET /v1/namespaces/{ns}": client.get("/v1/namespaces/run1"),
            "PUT /v1/namespaces/{ns}/settings": client.put(
                "/v1/namespaces/run1/settings", json={"max_policy_lag": 2}
            ),
            "PUT /v1/namespaces/{ns}/policy-version": client.put(
                "/v1/namespaces/run1/policy-version", json={"policy_version": 3}
            ),
        }
    for endpoint, answer in answers.items():
        assert answer.status_code in (200, 201), (endpoint, answer.text)
        body = answer.json()
        namespace = body["namespaces"][0] if "namespaces" in body else body
        assert list(namespace) == list(rows), endpoint
        assert set(re.findall(r"\w+", code(rows["spec"]))) == set(namespace["spec"])
        settings = namespace["settings"]
        words = set(re.findall(r"\w+", code(rows["settings"])))
        assert words == {*settings, *settings["retention"], *settings["leasing"]}
        if endpoint == "GET /v1/namespaces/{ns}":
            assert namespace["trajectories"] == 0
        else:
            assert namespace["trajectories"] is None, endpoint
        if endpoint != "GET /v1/namespaces":
            assert "the namespace" in _endpoint_answer(endpoint), endpoint


def test_every_setting_is_named_in_the_docs() -> None:
    text = API.read_text() + (ROOT / "README.md").read_text()
    names = [f"R3STORE_{name.upper()}" for name in Settings.model_fields if name != "s3"] + [
        f"R3STORE_S3__{name.upper()}" for name in S3Settings.model_fields
    ]
    missing = [n for n in names if not re.search(rf"(?<![A-Z0-9_]){n}(?![A-Z0-9_])", text)]
    assert not missing
