"""Benchmark runner: python -m shared_core.bench <engine> (see common.py)."""
