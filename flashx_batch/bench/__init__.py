"""Benchmarks: ratios measured side by side in one process (machines are noisy), written to JSON.

Not tests: nothing here asserts; the tests assert correctness, these report speed.
"""
