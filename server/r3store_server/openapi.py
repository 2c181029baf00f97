"""The OpenAPI schema, with integer bounds as exact integers and path parameters in
the order of their path.

FastAPI's schema model types `minimum` and `maximum` as floats, so a bound of
`2**63 - 1` would be published as `9.223372036854776e18`: a float, and above the
bound. The exact values come from the pydantic models' own JSON schemas. It lists a
route's own path parameters before those its dependencies declare (a namespace taken
with `deps.NamespaceDep`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_EXACT_FLOAT = 2**53


def _schemas(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _schemas(value)
    elif isinstance(node, list):
        for value in node:
            yield from _schemas(value)


def _bounds(schema: Any) -> Iterator[tuple[dict[str, Any], str, Any]]:
    """Each bound an integer schema within `schema` sets: that schema, the bound's key
    and its value."""
    for node in _schemas(schema):
        if node.get("type") != "integer":
            continue
        for key in BOUNDS:
            if key in node:
                yield node, key, node[key]


def integer_bounds(models: list[type[BaseModel]]) -> dict[float, int]:
    """Each integer bound of `models`, keyed by the float FastAPI turns it into."""
    exact: dict[float, int] = {}
    for model in models:
        for _node, _key, value in _bounds(model.model_json_schema()):
            if not isinstance(value, int):
                continue
            if exact.setdefault(float(value), value) != value:
                raise RuntimeError(f"integer bounds {value} and {exact[float(value)]} clash")
    return exact


def exact_integers(schema: dict[str, Any], exact: dict[float, int]) -> dict[str, Any]:
    """`schema` with the bounds of its integer schemas as integers (in place)."""
    for node, key, value in _bounds(schema):
        if not isinstance(value, float):
            continue
        if value in exact:
            node[key] = exact[value]
        elif value.is_integer() and abs(value) <= _EXACT_FLOAT:
            node[key] = int(value)
        else:
            raise RuntimeError(f"cannot restore the integer bound {value!r} exactly")
    return schema


def path_order(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with each operation's path parameters in the order its path names them,
    before its other parameters (in place)."""
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            operation.get("parameters", []).sort(
                key=lambda p: path.find(f"{{{p['name']}}}") if p["in"] == "path" else len(path)
            )
    return schema


def install(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Serve the schema of `app` with the exact integer bounds of `models`."""
    exact = integer_bounds(models)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                summary=app.summary,
                routes=app.routes,
            )
            app.openapi_schema = path_order(exact_integers(schema, exact))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
