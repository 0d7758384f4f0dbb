"""The tokenizer: a byte-level BPE learned the way MiniMind does it, or the user's tokenizer.json.

Learning reads the corpus as a stream of documents. A corpus above TRAIN_SAMPLE_BYTES is learned
from a deterministic sample: every k-th document, k = ceil(corpus bytes / TRAIN_SAMPLE_BYTES), so
about TRAIN_SAMPLE_BYTES of text whatever the corpus size; a smaller corpus is learned whole.

Token ids are stored as uint16 when the vocabulary has at most 65,536 tokens, else as uint32.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from exactresume.errors import UserError

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2, MiniMind's order
END_OF_TEXT = SPECIAL_TOKENS[0]
DEFAULT_VOCAB_SIZE = 6400
BYTE_ALPHABET_SIZE = 256
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + BYTE_ALPHABET_SIZE  # the trainer always keeps all 256 bytes
MAX_VOCAB_SIZE = 1 << 16  # what we learn ourselves; a user's tokenizer may be larger (uint32 ids)
TRAIN_SAMPLE_BYTES = 256 << 20  # a larger corpus is learned from a sample of about this size


def token_dtype(id_bound: int) -> np.dtype:
    """uint16 while every id (all below `id_bound`) fits, else uint32."""
    return np.dtype(np.uint16) if id_bound <= 1 << 16 else np.dtype(np.uint32)


def sample_stride(corpus_bytes: int) -> int:
    """Learn from every k-th document: 1 up to TRAIN_SAMPLE_BYTES of corpus."""
    return max(1, math.ceil(corpus_bytes / TRAIN_SAMPLE_BYTES))


def every_kth(documents: Iterable[str], k: int) -> Iterator[str]:
    for index, document in enumerate(documents):
        if index % k == 0:
            yield document


def train_tokenizer(documents: Iterable[str], vocab_size: int) -> Tokenizer:
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
    tokenizer.train_from_iterator(documents, trainer=trainer)
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
    """The user's tokenizer.json, checked to know <|endoftext|> (tokenizers' ids are u32: any fits uint32)."""
    try:
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as error:  # the Rust side raises plain Exception for any parse failure
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(f"cannot load tokenizer {path}: {reason}") from None
    if tokenizer.token_to_id(END_OF_TEXT) is None:
        raise UserError(f"tokenizer {path} has no {END_OF_TEXT} token to separate documents")
    return tokenizer
