"""Which linears HyScale's specs take: Transformer Engine's when asked for and importable, else
megatron's local ones, and a warning (once) when TE was asked for but does not import."""

from __future__ import annotations

import warnings

import pytest

from hyscale_bench.models import tiny_dsa_config
from megatron_hyscale import specs


@pytest.fixture
def no_te(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(specs, "te_available", lambda: False)
    specs._warn_local_linears.cache_clear()
    yield
    specs._warn_local_linears.cache_clear()


def test_transformer_engine_asked_without_te_warns_once_and_builds_local(no_te: None) -> None:
    cfg = tiny_dsa_config(transformer_impl="transformer_engine")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = specs.get_backend(cfg)
        second = specs.get_backend(cfg)
    assert isinstance(first, specs.LocalDSASpecProvider)
    assert isinstance(second, specs.LocalDSASpecProvider)
    said = [str(w.message) for w in caught if "transformer_engine" in str(w.message)]
    assert len(said) == 1 and "local (torch) linears" in said[0]


def test_local_asked_builds_local_without_a_warning(no_te: None) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = specs.get_backend(tiny_dsa_config(transformer_impl="local"))
    assert isinstance(backend, specs.LocalDSASpecProvider)
    assert not [w for w in caught if "transformer_engine" in str(w.message)]
