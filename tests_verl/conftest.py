"""The r3store server and client (`served`, from tests/),
and namespaces for verl's routes."""

from __future__ import annotations

import pytest
from verl_rollout import make_namespace

from r3store_client import Client

pytest_plugins = ["served"]


@pytest.fixture
def namespace(client: Client) -> str:
    """A fresh namespace for the tiny model's routes that keeps the engine's top-k order,
    as verl's tensor keeps it."""
    return make_namespace(client, ordered=True)
