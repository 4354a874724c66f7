"""Helpers for tests and the demo: megatron-core on CPU, tiny DSA models."""
