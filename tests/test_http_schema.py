"""Schemathesis over the OpenAPI schema, every operation it lists, with valid requests
and with invalid ones (its negative mode): no 5xx, every response matches the schema,
and invalid data is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from helpers import make_write
from http_helpers import KEYS, SPEC_JSON, ServerProcess
from r3store.protocol.wire import CONTENT_TYPE, encode_writes

ADMIN = {"Authorization": f"Bearer {KEYS['admin']}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp: Path = tmp_path_factory.mktemp("schema")
    # the generated requests send made-up keys: no limit on unknown keys here, or the
    # admin key's requests would be refused with the rest once the limit is reached
    process = ServerProcess(tmp, None, env={"R3STORE_AUTH_FAILURE_LIMIT": "0"})
    with httpx.Client(base_url=process.url, headers=ADMIN) as http:
        http.post("/v1/namespaces", json={"name": "ns", "spec": SPEC_JSON})
        http.post(
            "/v1/namespaces/ns/trajectories",
            content=encode_writes([make_write(f"t{i}") for i in range(3)]),
            headers={"Content-Type": CONTENT_TYPE},
        )
    yield process
    process.stop()


@schemathesis.serializer(CONTENT_TYPE)
def _arrow_body(ctx: object, value: object) -> bytes:
    """Generated upload bodies: arbitrary bytes (the server must refuse them cleanly)."""
    return value if isinstance(value, bytes) else str(value).encode()


CHECKS = [
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
    content_type_conformance,
]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_api_conforms_to_its_schema(server: ServerProcess, mode: GenerationMode) -> None:
    listed = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == sum(len(methods) for methods in listed.values())
    checks = CHECKS if mode is GenerationMode.POSITIVE else [*CHECKS, negative_data_rejection]
    ran = 0
    for operation in operations:

        @given(case=operation.as_strategy(mode))
        @settings(
            max_examples=25,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: schemathesis.Case) -> None:
            case.call_and_validate(base_url=server.url, headers=ADMIN, checks=checks)

        try:
            check()
        except Unsatisfiable:  # nothing in its request can be invalid: no input at all
            assert mode is GenerationMode.NEGATIVE, operation.label
            entry = listed[operation.path][operation.method.lower()]
            assert not entry.get("parameters"), operation.label
            assert "requestBody" not in entry, operation.label
        ran += 1
    assert ran == len(operations)
