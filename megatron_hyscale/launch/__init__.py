"""Launch helpers for the examples: memory estimates, command building, Megatron-LM log parsing.

Standard library only (no torch, no megatron), so the launch scripts' `--dry-run` works on a
machine with nothing but Python.
"""
