"""Benchmarks: each compares hybridkv with a simple baseline side by side in one run."""
