"""The engine against a plain model of what it should hold (`r3store.testing.engine_machine`),
over the local store and a SQLite catalog."""

from __future__ import annotations

from r3store.testing.engine_machine import engine_machine

TestEngineMachine = engine_machine().TestCase
