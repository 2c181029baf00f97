"""The catalog's schema revisions, oldest first: `v0001_schema` (revision `0001`),
`v0002_leases` (`0002`), `v0003_upload_writers` (`0003`)."""
