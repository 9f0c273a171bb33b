"""Benchmark helpers: background interconnect load, timing utilities."""
