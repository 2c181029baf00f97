"""Benchmarks: `python -m bench` (or `make bench`) prints a table and writes
`bench/results/latest.json`."""
