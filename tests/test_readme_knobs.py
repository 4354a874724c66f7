"""README's table of knobs names every field of the kernel option objects."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from megatron_hyscale.ops.kernels import options

README = Path(__file__).resolve().parents[1] / "README.md"
OPTION_CLASSES = (options.HyTopKOptions, options.AttentionKernelOptions,
                  options.IndexerLossKernelOptions)


def undocumented(text: str) -> list[str]:
    """The option fields no `name` in text mentions."""
    named = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", text))
    return [f"{cls.__name__}.{f.name}" for cls in OPTION_CLASSES
            for f in dataclasses.fields(cls) if f.name not in named]


def test_every_option_field_is_in_the_readme():
    assert undocumented(README.read_text()) == []


def test_a_field_left_out_is_found():
    text = README.read_text().replace("`scores_sm90_stages`", "scores_sm90_stages")
    assert undocumented(text) == ["HyTopKOptions.scores_sm90_stages"]
