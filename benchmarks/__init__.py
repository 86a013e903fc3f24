"""Benchmarks, run as ``python -m benchmarks NAME``; results go to BENCHMARKS.md."""
