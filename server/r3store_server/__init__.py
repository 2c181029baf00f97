"""The r3store HTTP service: a thin FastAPI layer over `r3store.engine`."""
