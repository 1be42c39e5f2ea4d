"""Benchmarks of the orchestrator (not tests): run ``python bench/bench.py``."""
