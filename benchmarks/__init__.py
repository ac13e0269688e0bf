"""Benchmarks run on the GPU machine; results go to benchmarks/RESULTS.md."""
