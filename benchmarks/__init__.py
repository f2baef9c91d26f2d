"""Benchmarks behind ``dask-services bench`` (never timed assertions in the tests)."""
