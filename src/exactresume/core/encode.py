"""Documents -> token stream: tokenizers' batch encoder on all cores, overlapped with reading.

Documents are gathered into batches of about `batch_bytes` characters. While tokenizers encodes one
batch on its own threads (it releases the GIL), this thread reads and parses the next: at most
two batches and one batch of tokens are held at once. Each document is encoded on its own, so the
stream is the same whatever the batch size or thread count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import chain
from typing import Protocol

import numpy as np
from tokenizers import Tokenizer

ENCODE_BATCH_BYTES = 1 << 20  # characters per encode_batch call: tokenizers holds ~75 bytes per character


class TokenSink(Protocol):
    dtype: np.dtype

    def write(self, tokens: np.ndarray) -> None: ...


def batches(documents: Iterable[str], batch_bytes: int) -> Iterator[list[str]]:
    """Consecutive documents in lists of at least `batch_bytes` characters (the last may be shorter)."""
    batch: list[str] = []
    size = 0
    for document in documents:
        batch.append(document)
        size += len(document)
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encode_batch(tokenizer: Tokenizer, batch: list[str], end_of_text_id: int, dtype: np.dtype) -> np.ndarray:
    """The batch's documents as one token array, each followed by `end_of_text_id`."""
    # encode_batch_fast: the same ids as encode_batch, without computing character offsets.
    ids = [encoding.ids for encoding in tokenizer.encode_batch_fast(batch, add_special_tokens=False)]
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
    return np.insert(flat, np.cumsum(lengths), end_of_text_id)


def encode_stream(
    tokenizer: Tokenizer,
    documents: Iterable[str],
    end_of_text_id: int,
    sink: TokenSink,
    batch_bytes: int | None = None,
    report: Callable[[], object] | None = None,
) -> int:
    """Encode `documents` into `sink` in order; the number of documents. `report()` after each batch."""
    count = 0
    pending: Future | None = None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode") as pool:
        for batch in batches(documents, batch_bytes or ENCODE_BATCH_BYTES):
            count += len(batch)
            submitted = pool.submit(encode_batch, tokenizer, batch, end_of_text_id, sink.dtype)
            if pending is not None:
                sink.write(pending.result())
                if report is not None:
                    report()
            pending = submitted
        if pending is not None:
            sink.write(pending.result())
    if report is not None:
        report()
    return count
