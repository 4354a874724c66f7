"""HyScale: fast, exact, memory-bounded learned sparse attention for Megatron-core."""

__version__ = "0.1.0"
