"""``python -m bench.summary``: run the benchmarks of bench/ and write BENCHMARKS.md from their
results."""
