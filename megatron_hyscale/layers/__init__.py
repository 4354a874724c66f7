"""Megatron modules that replace the stock learned-sparse-attention blocks."""
