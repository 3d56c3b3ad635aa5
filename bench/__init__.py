"""Benchmarks that run against the local Pub/Sub emulator (see bench/README.md)."""
