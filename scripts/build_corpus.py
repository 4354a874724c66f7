#!/usr/bin/env python3
"""Build the standard-library text corpus as a Megatron indexed dataset (.bin / .idx).

    python scripts/build_corpus.py --out corpus/ --vocab-size 32768 [--limit-mb 64]

Writes OUT/<key>/stdlib.jsonl (the text, one source file a line), the dataset
OUT/<key>/stdlib_text_document.{bin,idx} (UTF-8 bytes, end-of-document id vocab_size - 1, for
`--tokenizer-type NullTokenizer --vocab-size V`) and manifest.json; prints the --data-path
prefix. `python -m megatron_hyscale.evaluate --data stdlib` builds the same on demand
(megatron_hyscale/launch/corpus.py says why this corpus and this tokenizer).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_hyscale.launch.corpus import ensure_stdlib_corpus  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="cache folder of corpora")
    p.add_argument("--vocab-size", type=int, required=True,
                   help="the run's --vocab-size (> 256); the end-of-document id is one below")
    p.add_argument("--limit-mb", type=float, default=None,
                   help="stop after this many MiB of text (default: every source file)")
    args = p.parse_args(argv)
    if args.limit_mb is not None and args.limit_mb <= 0:
        p.error(f"--limit-mb must be > 0, got {args.limit_mb}")
    limit = None if args.limit_mb is None else int(args.limit_mb * 2**20)
    try:
        prefix, manifest = ensure_stdlib_corpus(args.out, args.vocab_size, limit)
    except ValueError as err:
        p.error(str(err))
    print(f"--data-path {prefix}  ({manifest['tokens']:,} tokens, "
          f"{manifest['documents']} documents)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
