"""Streaming prepare: the same bytes whatever the chunk sizes, bounded memory, memory-mapped and
xxh3-verified loading, and the corpus faults a user meets (cut-off last line, empty file)."""

from __future__ import annotations

import gc
import io
import json
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from exactresume.core import data as data_module
from exactresume.core import tokenizer as tokenizer_module
from exactresume.core.data import (
    MANIFEST_FILE,
    TOKENIZER_FILE,
    TRAIN_FILE,
    VAL_FILE,
    PrepareConfig,
    load_tokens,
    prepare,
)
from exactresume.errors import UserError
from exactresume.progress import ByteProgress
from helpers import assert_one_line_error, call_cli

OUTPUT_FILES = (TOKENIZER_FILE, TRAIN_FILE, VAL_FILE, MANIFEST_FILE)
VOCAB = 300


def quiet(_line: str) -> None:
    pass


def edge_jsonl(path: Path) -> Path:
    """Chapters of verses, CRLF and LF line ends, blank lines, non-ASCII, U+2028 inside a string."""
    texts = ["In the beginning.", "Tabs\tand  spaces ", "é ü 中文 😀", "a line\u2028separator", "the end"]
    records = [{"text": texts[i % 5], "book": "B", "chapter": i // 3} for i in range(90)]
    lines = [json.dumps(record, ensure_ascii=i % 2 == 0) for i, record in enumerate(records)]
    path.write_bytes(("\n".join(lines[:40]) + "\n\n  \n" + "\r\n".join(lines[40:])).encode())
    return path


def edge_txt(path: Path) -> Path:
    paragraphs = [f"Paragraph {i}: {'é ü 中文 ' * (i % 4)}words\r\nover two lines." for i in range(60)]
    path.write_bytes(("\n\n" + "\r\n \t\r\n".join(paragraphs[:30]) + "\n\n\n" + "\n\n".join(paragraphs[30:])).encode())
    return path


def output_bytes(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in OUTPUT_FILES}


@pytest.mark.parametrize("make", [edge_jsonl, edge_txt])
def test_output_is_byte_identical_whatever_the_chunk_sizes(tmp_path, make):
    corpus = make(tmp_path / f"corpus.{make.__name__.split('_')[1]}")
    config = PrepareConfig(corpus=corpus, vocab_size=VOCAB)
    prepare(config, tmp_path / "default", log=quiet)
    reference = output_bytes(tmp_path / "default")
    for chunk, batch in [(1, 1), (7, 50), (100, 10_000), (4096, 3)]:
        out = tmp_path / f"chunk-{chunk}-{batch}"
        prepare(config, out, log=quiet, chunk_bytes=chunk, batch_bytes=batch)
        assert output_bytes(out) == reference, (chunk, batch)


def python_peak_preparing(corpus: Path, tokenizer: Path, out: Path) -> int:
    gc.collect()  # garbage of earlier tests in this worker is not this run's peak
    tracemalloc.start()
    try:
        config = PrepareConfig(corpus=corpus, tokenizer=tokenizer)
        prepare(config, out, log=quiet, chunk_bytes=1 << 16, batch_bytes=1 << 16)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_does_not_grow_with_the_corpus(tmp_path):
    prepare(PrepareConfig(corpus=edge_txt(tmp_path / "small.txt"), vocab_size=VOCAB), tmp_path / "tok", log=quiet)
    peaks = {}
    for documents in (5_000, 80_000):
        corpus = tmp_path / f"{documents}.jsonl"
        corpus.write_text(
            "".join(json.dumps({"text": f"Document {i} of {i * 7 % 1000} sheep."}) + "\n" for i in range(documents))
        )
        peaks[corpus.stat().st_size] = python_peak_preparing(
            corpus, tmp_path / "tok" / TOKENIZER_FILE, tmp_path / f"out{documents}"
        )
    (small, small_peak), (large, large_peak) = sorted(peaks.items())
    assert large > 15 * small and large > 3_000_000
    # Fixed buffers, nothing per document kept: even 8 bytes for each of the 75,000 more documents
    # is 600 kB, while the peak of equal runs differs by up to ~120 kB under a loaded worker.
    assert large_peak < small_peak + 300_000, peaks


def test_progress_reports_corpus_bytes_up_to_the_whole_file(tmp_path):
    corpus = edge_txt(tmp_path / "corpus.txt")
    calls: list[tuple[int, int]] = []
    prepare(
        PrepareConfig(corpus=corpus, vocab_size=VOCAB),
        tmp_path / "out",
        log=quiet,
        progress=lambda *a: calls.append(a),
        chunk_bytes=512,
        batch_bytes=256,
    )
    size = corpus.stat().st_size
    assert len(calls) > 2 and calls[-1] == (size, size)
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)


def test_train_is_a_memory_map_checked_by_xxh3(tmp_path):
    out = tmp_path / "out"
    manifest = prepare(PrepareConfig(corpus=edge_txt(tmp_path / "c.txt"), vocab_size=VOCAB), out, log=quiet)
    assert manifest.train_xxh3 and manifest.val_xxh3 and manifest.tokenizer_xxh3
    data = load_tokens(out)
    assert isinstance(data.train, np.memmap) and isinstance(data.val, np.memmap)
    assert not data.train.flags.writeable and len(data.train) == manifest.train_tokens
    with open(out / TRAIN_FILE, "r+b") as file:  # flip one byte of the last token
        file.seek(-1, 2)
        last = file.read(1)
        file.seek(-1, 2)
        file.write(bytes([last[0] ^ 1]))
    with pytest.raises(UserError, match="train.npy does not match its xxh3"):
        load_tokens(out)


def test_a_manifest_from_before_xxh3_still_loads_and_is_checked_by_sha256(tmp_path):
    out = tmp_path / "out"
    prepare(PrepareConfig(corpus=edge_txt(tmp_path / "c.txt"), vocab_size=VOCAB), out, log=quiet)
    recorded = json.loads((out / MANIFEST_FILE).read_text())
    old = {name: value for name, value in recorded.items() if not name.endswith("_xxh3")}
    (out / MANIFEST_FILE).write_text(json.dumps(old, indent=2) + "\n")
    data = load_tokens(out)
    assert data.manifest.train_xxh3 is None and data.fingerprint == recorded["fingerprint"]
    (out / VAL_FILE).write_bytes((out / VAL_FILE).read_bytes()[:-2] + b"\1\0")
    with pytest.raises(UserError, match="val.npy does not match its sha256"):
        load_tokens(out)


def test_a_corpus_cut_off_mid_line_names_the_line(tmp_path):
    corpus = tmp_path / "cut.jsonl"
    corpus.write_text('{"text": "one"}\n{"text": "two"}\n{"text": "thr', encoding="utf-8")
    finished = call_cli("prepare", "--out", tmp_path / "out", "--corpus", corpus, "--quiet")
    assert_one_line_error(finished, "line 3", "not valid JSON", "ends mid-line")


def test_a_last_line_without_newline_is_read(tmp_path):
    corpus = tmp_path / "no-newline.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"verse {i} " * 20}) + "\n" for i in range(30)) + '{"text": "last"}')
    manifest = prepare(PrepareConfig(corpus=corpus, vocab_size=270), tmp_path / "out", log=quiet)
    assert manifest.documents == 31


@pytest.mark.parametrize("content", [b"", b"\n\n  \n", b'{"text": ""}\n'])
@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_an_empty_corpus_is_refused(tmp_path, content, suffix):
    if suffix == ".txt" and content.startswith(b"{"):
        content = b" \t \n"
    corpus = tmp_path / f"empty{suffix}"
    corpus.write_bytes(content)
    finished = call_cli("prepare", "--out", tmp_path / "out", "--corpus", corpus, "--quiet")
    assert_one_line_error(finished, "holds no text")
    assert not (tmp_path / "out" / TRAIN_FILE).exists() and not (tmp_path / "out" / (TRAIN_FILE + ".tmp")).exists()


def test_bad_utf8_is_named_by_its_offset_across_chunks(tmp_path):
    corpus = tmp_path / "bad.txt"
    corpus.write_bytes(b"hello world\n" * 100 + b"caf\xe9\n")
    with pytest.raises(UserError, match="offset 1203"):
        prepare(PrepareConfig(corpus=corpus, vocab_size=VOCAB), tmp_path / "out", log=quiet, chunk_bytes=64)


def test_the_cli_progress_object_shows_corpus_megabytes(tmp_path):
    stream = io.StringIO()
    progress = ByteProgress("prepare: encode", "lines", stream=stream)
    corpus = edge_txt(tmp_path / "corpus.txt")
    config = PrepareConfig(corpus=corpus, vocab_size=VOCAB)
    prepare(config, tmp_path / "out", log=quiet, progress=progress, batch_bytes=200)  # read at once, many batches
    lines = stream.getvalue().splitlines()
    assert lines[-1].startswith("prepare: encode: MB 1/1")
    assert [line for line in lines if "MB 1/1" in line] == lines[-1:], lines  # the end said once


def test_the_rate_of_a_corpus_encoded_at_once_is_over_the_encoding_time(tmp_path, monkeypatch):
    """One batch holds the whole corpus, so the first report comes at its end: the rate still counts the
    encoding's seconds, not the instant between that report and the line."""
    encode = data_module.encode_stream

    def slow_encode(*args, **kwargs):
        time.sleep(0.5)
        return encode(*args, **kwargs)

    monkeypatch.setattr(data_module, "encode_stream", slow_encode)
    stream = io.StringIO()
    corpus = edge_txt(tmp_path / "corpus.txt")
    config = PrepareConfig(corpus=corpus, vocab_size=VOCAB)
    prepare(config, tmp_path / "out", log=quiet, progress=ByteProgress("prepare: encode", "lines", stream=stream))
    words = stream.getvalue().splitlines()[-1].split()  # prepare: encode: MB 1/1 R MB/s
    megabytes, rate = int(words[3].split("/")[0]), float(words[-2])
    assert rate <= megabytes / 0.5, stream.getvalue()


def test_a_large_corpus_learns_its_tokenizer_from_a_fixed_sample(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "TRAIN_SAMPLE_BYTES", 2_000)  # "large" above 2 kB
    corpus = edge_txt(tmp_path / "corpus.txt")
    lines: list[str] = []
    config = PrepareConfig(corpus=corpus, vocab_size=270)
    prepare(config, tmp_path / "a", log=lines.append)
    stride = -(-corpus.stat().st_size // 2_000)
    assert stride > 1 and any(f"one document in {stride}" in line for line in lines)
    prepare(config, tmp_path / "b", log=quiet, chunk_bytes=333)
    assert output_bytes(tmp_path / "a") == output_bytes(tmp_path / "b")
    monkeypatch.setattr(tokenizer_module, "TRAIN_SAMPLE_BYTES", 1 << 30)
    whole = prepare(config, tmp_path / "c", log=quiet)
    assert whole.tokenizer_sha256 != load_tokens(tmp_path / "a").manifest.tokenizer_sha256
