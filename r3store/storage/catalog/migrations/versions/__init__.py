"""The catalog's schema revisions, oldest first: `v0001_schema` (revision `0001`)."""
