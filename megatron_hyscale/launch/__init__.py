"""Launch helpers for the examples: memory estimates, command building, Megatron-LM log parsing.

Standard library only (no torch, no megatron), so the launch scripts' `--dry-run` works on a
machine with nothing but Python. The exception is `train_gpt`, HyScale's minimal GPT training
entry point (`python -m megatron_hyscale.launch.train_gpt`), which runs megatron.training and
is only ever imported by the training processes.
"""
