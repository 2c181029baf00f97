"""The catalog's schema migrations (Alembic): `env.py` runs them on the connection that
`r3store.storage.catalog.migrate` hands it; `versions/` holds the revisions."""
