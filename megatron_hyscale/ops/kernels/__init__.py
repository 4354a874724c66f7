"""Triton kernels and their launch wrappers (depend on torch and triton only)."""
