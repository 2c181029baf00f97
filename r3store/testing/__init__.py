"""Helpers for tests and benchmarks: a real S3 server on free ports, synthetic routes."""
