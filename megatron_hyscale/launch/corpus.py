"""A real-text training corpus every machine has: the Python standard library's own sources.

Why: an evaluation on mock data (uniform random tokens) says nothing about how an indexer
learns to select, and the GPU machines have no network to fetch a corpus. The standard
library's `.py` files (code, docstrings, comments; `pydoc_data/topics.py` holds the language
reference's text) are present wherever Python is, and are the same bytes for one Python
version, so a corpus built from them is reproducible.

Tokens are UTF-8 bytes (ids 0-255) and one end-of-document id, `vocab_size - 1`, after each
file: Megatron-LM's `--tokenizer-type NullTokenizer --vocab-size V` has exactly that
end-of-document id and needs no vocabulary file (a GPT-2 BPE would need files not available
offline). Each file is one document of a Megatron indexed dataset (`.bin` / `.idx`, written by
megatron-core's `IndexedDatasetBuilder`, as Megatron-LM's `tools/preprocess_data.py
--append-eod` writes them); Megatron's `GPTDataset` concatenates the documents and cuts
sequences of the run's length across their boundaries, so long runs see long contexts.

The module imports only the standard library; `build_indexed` imports numpy, torch and
megatron-core when it runs.
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

BYTE_VOCAB = 256  # token ids of the bytes; the end-of-document id is vocab_size - 1 above them
MANIFEST = "manifest.json"


def stdlib_root() -> Path:
    """The standard library's source folder of this interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path | None = None) -> list[Path]:
    """Every `.py` file under the standard library, sorted by relative path (deterministic),
    without third-party packages (site-packages / dist-packages)."""
    root = root or stdlib_root()
    files = [p for p in root.rglob("*.py")
             if not {"site-packages", "dist-packages", "__pycache__"} & set(p.relative_to(root)
                                                                          .parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def iter_documents(limit_bytes: int | None, root: Path | None = None
                   ) -> Iterator[tuple[str, str]]:
    """(relative path, text) of the sources in order, until `limit_bytes` of UTF-8 text (the
    file that crosses the limit is cut there); None: all of them. Undecodable files skipped."""
    root = root or stdlib_root()
    total = 0
    for path in stdlib_sources(root):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        if limit_bytes is not None:
            left = limit_bytes - total
            if left <= 0:
                return
            data = text.encode("utf-8")
            if len(data) > left:
                text = data[:left].decode("utf-8", errors="ignore")
        total += len(text.encode("utf-8"))
        yield path.relative_to(root).as_posix(), text


def write_jsonl(path: Path, limit_bytes: int | None, root: Path | None = None) -> tuple[int, int]:
    """The documents as JSON lines {"path": ..., "text": ...} (Megatron's preprocess_data.py
    input format). Returns (documents, UTF-8 bytes of text)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    docs = size = 0
    with open(path, "w", encoding="utf-8") as out:
        for rel, text in iter_documents(limit_bytes, root):
            out.write(json.dumps({"path": rel, "text": text}) + "\n")
            docs += 1
            size += len(text.encode("utf-8"))
    if docs == 0:
        raise ValueError(f"no standard-library sources found under {root or stdlib_root()}")
    return docs, size


def eod_id(vocab_size: int) -> int:
    """NullTokenizer's end-of-document id."""
    return vocab_size - 1


def build_indexed(jsonl: Path, prefix: Path, vocab_size: int) -> int:
    """Tokenize `jsonl` (bytes + end of document) into `prefix`.bin / .idx; returns the token
    count. vocab_size: the run's --vocab-size (at least 257: the bytes and the end id)."""
    if vocab_size <= BYTE_VOCAB:
        raise ValueError(f"vocab_size must be > {BYTE_VOCAB} (byte ids 0-255 and an "
                         f"end-of-document id), got {vocab_size}")
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import (
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

    dtype = np.uint16 if vocab_size <= 65535 else np.int32
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(get_bin_path(str(prefix)), dtype=dtype)
    tokens = 0
    end = eod_id(vocab_size)
    with open(jsonl, encoding="utf-8") as src:
        for line in src:
            data = json.loads(line)["text"].encode("utf-8")
            ids = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
            ids = np.append(ids, end)
            builder.add_item(torch.from_numpy(ids))
            builder.end_document()
            tokens += ids.size
    builder.finalize(get_idx_path(str(prefix)))
    return tokens


def corpus_key(vocab_size: int, limit_bytes: int | None) -> str:
    """The cache name of a corpus: Python version, vocabulary and limit (same key, same
    bytes)."""
    version = ".".join(map(str, sys.version_info[:3]))
    digest = hashlib.sha256(f"{stdlib_root()}|{version}".encode()).hexdigest()[:8]
    limit = "all" if limit_bytes is None else f"{limit_bytes}B"
    return f"stdlib-py{version}-{digest}-v{vocab_size}-{limit}"


def ensure_stdlib_corpus(cache_dir: Path, vocab_size: int, limit_bytes: int | None = None,
                         log: bool = True) -> tuple[Path, dict]:
    """The stdlib corpus for `vocab_size` under cache_dir, built on first use. Returns (the
    data-path prefix for Megatron-LM's --data-path, its manifest: documents, bytes, tokens)."""
    folder = cache_dir / corpus_key(vocab_size, limit_bytes)
    prefix = folder / "stdlib_text_document"
    manifest_path = folder / MANIFEST
    if manifest_path.is_file() and prefix.with_suffix(".bin").is_file():
        return prefix, json.loads(manifest_path.read_text())
    if log:
        print(f"[corpus] building the standard-library corpus in {folder} (once)", flush=True)
    jsonl = folder / "stdlib.jsonl"
    docs, size = write_jsonl(jsonl, limit_bytes)
    tokens = build_indexed(jsonl, prefix, vocab_size)
    manifest = {"source": str(stdlib_root()), "python": sys.version.split()[0],
                "documents": docs, "text_bytes": size, "tokens": tokens,
                "vocab_size": vocab_size, "eod_id": eod_id(vocab_size),
                "tokenizer": "UTF-8 bytes + end of document (NullTokenizer)",
                "limit_bytes": limit_bytes}
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    if log:
        print(f"[corpus] {docs} documents, {size / 2**20:.1f} MiB of text, {tokens:,} tokens",
              flush=True)
    return prefix, manifest
