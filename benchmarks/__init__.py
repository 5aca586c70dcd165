"""Benchmarks, the namespace testbed and the evaluation harness (not shipped with the package)."""
