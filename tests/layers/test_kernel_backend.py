"""Which kernels the layers ask the ops for: config attribute, then environment, then best."""

from __future__ import annotations

import types

import pytest

from megatron_hyscale.layers.kernel_backend import (
    ENV,
    PRECISION_ENV,
    indexer_precision,
    kernel_backend,
)


def test_default_is_the_measured_best(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert kernel_backend(types.SimpleNamespace()) == "best"


def test_config_attribute_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv(ENV, "cudnn")
    assert kernel_backend(types.SimpleNamespace()) == "cudnn"
    assert kernel_backend(types.SimpleNamespace(hyscale_kernel_backend="own")) == "auto"


@pytest.mark.parametrize("where", ["config", "env"])
def test_bad_value_names_its_source(monkeypatch, where):
    monkeypatch.delenv(ENV, raising=False)
    cfg = types.SimpleNamespace()
    if where == "config":
        cfg.hyscale_kernel_backend = "fast"
    else:
        monkeypatch.setenv(ENV, "fast")
    name = "config.hyscale_kernel_backend" if where == "config" else ENV
    with pytest.raises(ValueError, match=name):
        kernel_backend(cfg)


def test_indexer_precision_config_env_default(monkeypatch):
    monkeypatch.delenv(PRECISION_ENV, raising=False)
    assert indexer_precision(types.SimpleNamespace()) == "bf16"
    monkeypatch.setenv(PRECISION_ENV, "fp8")
    assert indexer_precision(types.SimpleNamespace()) == "fp8"
    assert indexer_precision(types.SimpleNamespace(hyscale_indexer_precision="bf16")) == "bf16"
    with pytest.raises(ValueError, match="config.hyscale_indexer_precision"):
        indexer_precision(types.SimpleNamespace(hyscale_indexer_precision="fp4"))
    monkeypatch.setenv(PRECISION_ENV, "e4m3")
    with pytest.raises(ValueError, match=PRECISION_ENV):
        indexer_precision(types.SimpleNamespace())
