"""Helpers of the reliability tests (``tests/test_reliability_*.py``) and ``benchmarks/soak.py``."""
