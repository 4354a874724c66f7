"""README's table of knobs names every field of the kernel option objects, each in a row that
names its class."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_hyscale.ops.kernels import options

README = Path(__file__).resolve().parents[1] / "README.md"
OPTION_CLASSES = (options.HyTopKOptions, options.AttentionKernelOptions,
                  options.IndexerLossKernelOptions)


def undocumented(text: str) -> list[str]:
    """The option fields no table row of text names (`name`) beside its class's name."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return [f"{cls.__name__}.{f.name}" for cls in OPTION_CLASSES
            for f in dataclasses.fields(cls)
            if not any(f"`{f.name}`" in row and cls.__name__ in row for row in rows)]


def test_every_option_field_is_in_the_readme():
    assert undocumented(README.read_text()) == []


def test_a_field_left_out_is_found():
    text = README.read_text()
    assert undocumented(text.replace("`scores_sm90_stages`", "scores_sm90_stages")) == [
        "HyTopKOptions.scores_sm90_stages"]
    # a name shared by two classes counts for the class its row names only
    without = "\n".join(line for line in text.splitlines()
                        if not ("`block_n`" in line and "IndexerLossKernelOptions" in line))
    assert "IndexerLossKernelOptions.block_n" in undocumented(without)
