"""scripts/build_corpus.py: the standard-library corpus as a Megatron indexed dataset."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_hyscale.launch import corpus

ROOT = Path(__file__).resolve().parents[2]


def test_builder_writes_a_readable_indexed_dataset(tmp_path: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    limit_mb = 0.05
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_corpus.py"), "--out",
                           str(tmp_path), "--vocab-size", "512", "--limit-mb", str(limit_mb)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    prefix = done.stdout.split("--data-path ")[1].split()[0]
    manifest = json.loads((Path(prefix).parent / corpus.MANIFEST).read_text())
    limit = int(limit_mb * 2**20)
    texts = [json.loads(line)["text"]
             for line in (Path(prefix).parent / "stdlib.jsonl").read_text().splitlines()]
    assert manifest["text_bytes"] == sum(len(t.encode()) for t in texts) <= limit
    assert manifest["text_bytes"] > limit - 8  # cut at the limit (a character at most short)

    data = IndexedDataset(prefix)
    assert len(data) == manifest["documents"] == len(texts)
    tokens = [np.asarray(data[i]) for i in range(len(data))]
    # one token per UTF-8 byte plus the end-of-document id (NullTokenizer's: vocab_size - 1)
    assert sum(t.size for t in tokens) == manifest["tokens"] == manifest["text_bytes"] + len(texts)
    for text, ids in zip(texts, tokens):
        assert ids[-1] == 511 and (ids[:-1] < 256).all()
        assert bytes(ids[:-1].astype(np.uint8)).decode() == text
    # deterministic order: the sorted stdlib paths
    first = corpus.stdlib_sources()[0].relative_to(corpus.stdlib_root()).as_posix()
    assert json.loads((Path(prefix).parent / "stdlib.jsonl").read_text().splitlines()[0])[
        "path"] == first


def test_vocabulary_must_hold_the_bytes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size must be > 256"):
        corpus.build_indexed(tmp_path / "x.jsonl", tmp_path / "x", 256)
