"""Alembic's environment for the catalog: migrations run only on the connection that
`r3store.storage.catalog.migrate` opened (inside its transaction, holding the database
against other migrations); there is no alembic.ini and no URL here."""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

connection = context.config.attributes.get("connection")
if not isinstance(connection, Connection):
    raise RuntimeError(
        "the catalog's migrations run through r3store.storage.catalog.migrate "
        "(`r3store migrate`), which hands them a connection"
    )
context.configure(connection=connection)
with context.begin_transaction():
    context.run_migrations()
