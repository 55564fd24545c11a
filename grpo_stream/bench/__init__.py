"""Benchmarks: scripts that measure and print figures (never timed tests)."""
