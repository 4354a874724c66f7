"""The known megatron-core warnings are hidden (pytest's configuration and the demo's helper),
each filter still matches what the pinned megatron-core says, and HyScale's warnings show."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings

import pytest

from megatron_hyscale.ops.hytopk import warn_once
from megatron_hyscale.testing.quiet import MEGATRON_WARNINGS, add_warning_filters

# Run in a fresh interpreter (import-time warnings included): import what warns at import,
# call what warns when used, build and run a tiny DSA GPT on CPU, then give a HyScale warning; print
# every warning that got through as JSON. argv[1] == "quiet": the helper's filters first.
SCENARIO = r"""
import argparse, json, sys, warnings
warnings.simplefilter("always")
if sys.argv[1] == "quiet":
    from megatron_hyscale.testing.quiet import add_warning_filters
    add_warning_filters()
shown = []
warnings.showwarning = lambda message, category, *rest, **kw: shown.append(
    [category.__name__, str(message)])
import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs
import megatron.core.hyper_comm_grid, megatron.core.inference.contexts
import megatron.training.utils.common_utils
from megatron.core._rank_utils import safe_get_rank
safe_get_rank()  # before torch.distributed is set up
from megatron.training.arguments import _add_rl_args
_add_rl_args(argparse.ArgumentParser())
from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
TESpecProvider().grouped_mlp_modules(False)
from hyscale_bench.cpu import init_single_process, megatron_on_cpu
from hyscale_bench.models import build_gpt, tiny_dsa_config
with megatron_on_cpu():
    init_single_process()
    config = tiny_dsa_config(recompute_granularity="selective", recompute_modules=["core_attn"])
    model = build_gpt(config, stock=False, vocab_size=32, max_sequence_length=32, device="cpu")
    import torch
    ids = torch.zeros(1, 32, dtype=torch.long)
    model(ids, torch.arange(32)[None], None)  # megatron's linears warn in their forward
from megatron_hyscale.ops.hytopk import warn_once
def hyscale_layer_forward():  # warn_once names its caller's caller, as in HyScale's layers
    warn_once("warnings-filter-test", "HyScale: a fast path was declined")
def caller():
    hyscale_layer_forward()
caller()
print("SHOWN=" + json.dumps(shown))
"""


def _run_scenario() -> dict[str, list[list[str]]]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    procs = {mode: subprocess.Popen([sys.executable, "-c", SCENARIO, mode], env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for mode in ("loud", "quiet")}
    shown = {}
    for mode, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        line = next(x for x in out.splitlines() if x.startswith("SHOWN="))
        shown[mode] = json.loads(line.removeprefix("SHOWN="))
    return shown


@pytest.fixture(scope="module")
def scenario() -> dict[str, list[list[str]]]:
    return _run_scenario()


def _matches(known, category: str, message: str) -> bool:
    return category == known.category.__name__ and re.match(known.message, message, re.I)


def test_pytest_config_has_the_helpers_filters(request: pytest.FixtureRequest) -> None:
    assert request.config.getini("filterwarnings") == [w.ini_line() for w in MEGATRON_WARNINGS]


def test_every_filter_matches_a_warning_megatron_core_gives(scenario) -> None:
    """Each filter is live (its message, category and module match what megatron-core 0.19.2
    says and where), and hides it."""
    for known in MEGATRON_WARNINGS:
        assert any(_matches(known, c, m) for c, m in scenario["loud"]), known.what
        assert not any(_matches(known, c, m) for c, m in scenario["quiet"]), known.what


def test_hyscale_warning_passes_the_filters(scenario) -> None:
    for mode in ("loud", "quiet"):
        assert ["RuntimeWarning", "HyScale: a fast path was declined"] in scenario[mode]


def test_nothing_else_is_hidden(scenario) -> None:
    hidden = [w for w in scenario["loud"] if w not in scenario["quiet"]]
    for category, message in hidden:
        assert any(_matches(k, category, message) for k in MEGATRON_WARNINGS), message


def test_pytest_shows_hyscale_warnings() -> None:
    """Under pytest's own filters (this test does not reset them): a HyScale warning is
    recorded, the same text said by a megatron-core module is not (filters are per module)."""
    text = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
    def hyscale_layer_forward() -> None:  # warn_once names its caller's caller
        warn_once("pytest-shows-hyscale-warnings", "HyScale: declined")

    with warnings.catch_warnings(record=True) as got:
        hyscale_layer_forward()
        warnings.warn_explicit(text, UserWarning, "optimizer.py", 1,
                               module="megatron.core.optimizer")
        warnings.warn_explicit(text, UserWarning, "specs.py", 1, module="megatron_hyscale.specs")
    assert [(str(w.message), w.filename) for w in got] == [
        ("HyScale: declined", __file__), (text, "specs.py")]


def test_helper_filters_are_scoped_to_megatron_modules() -> None:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        add_warning_filters()
        for known in MEGATRON_WARNINGS:
            # A message each filter's regex matches, from megatron's module and from HyScale's.
            message = re.sub(r"\\(.)", r"\1", known.message).replace(".type.", "'type'")
            module = known.module.replace("\\", "").rstrip(".")
            warnings.warn_explicit(message, known.category, "m.py", 1, module=module + ".x")
            warnings.warn_explicit(message, known.category, "h.py", 1,
                                   module="megatron_hyscale.layers")
    assert [w.filename for w in got] == ["h.py"] * len(MEGATRON_WARNINGS)
