"""What a streaming dataset keeps of its position: a Hugging Face `datasets` IterableDataset's state_dict()
(the shards' position, not a shuffle buffer's content: its load_state_dict() refills the buffer), and the
torch.Generators a plain IterableDataset holds to shuffle its stream.

Read without importing `datasets`: a script that streams with it has loaded it already.
"""

from __future__ import annotations

import torch

from .fingerprint import dicts_in, digest


def hugging_face(dataset) -> bool:
    """A `datasets` IterableDataset: its state_dict() is its position in the stream."""
    return type(dataset).__module__.startswith("datasets.") and callable(getattr(dataset, "state_dict", None))


def buffer_size(dataset) -> int | None:
    """The shuffle buffer's size of a `datasets` IterableDataset shuffled with .shuffle(buffer_size=), else None."""
    node, seen = getattr(dataset, "_ex_iterable", None), 0
    while node is not None and seen < 16:  # its examples iterables wrap one another, the outermost first
        size = getattr(node, "buffer_size", None)
        if isinstance(size, int):
            return size
        node, seen = getattr(node, "ex_iterable", None), seen + 1
    return None


def generators(dataset) -> list[tuple[str, torch.Generator]]:
    """The torch.Generators a plain IterableDataset holds as attributes (a shuffle buffer's)."""
    if hugging_face(dataset):
        return []
    found = vars(dataset).items() if hasattr(dataset, "__dict__") else ()
    return [(f"{type(dataset).__name__}.{name}", g) for name, g in found if isinstance(g, torch.Generator)]


def words(dataset) -> str:
    """The stream, in words: what yields its order and where its position is kept."""
    if not hugging_face(dataset):
        held = generators(dataset)
        shuffle = f", shuffled by {held[0][0]} (a torch.Generator)" if held else ""
        return f"an IterableDataset ({type(dataset).__name__}) that yields its own order{shuffle}"
    size = buffer_size(dataset)
    shuffle = f", shuffled through a buffer of {size} examples" if size else ""
    return f"a Hugging Face datasets IterableDataset{shuffle} (its position kept by its state_dict())"


def rows(dataset, saved, held: set) -> list[dict]:
    """Whether `saved` (a checkpoint being written) holds the stream's state as it is now: a `datasets`
    dataset's state_dict(), a plain stream's generators' states (`held`: the digests of the file's tensors)."""
    if hugging_face(dataset):
        try:
            state = digest(dataset.state_dict())
        except Exception:  # a version whose state_dict() fails here: the stream unjudged, the rest of the file seen
            return []
        found = any(digest(d) == state for d in dicts_in(saved))
        detail = "" if found else "its state_dict() is not in the file"
        name = "the datasets IterableDataset's state_dict()"
        return [{"kind": "stream", "name": name, "saved": found, "detail": detail, "buffer": buffer_size(dataset)}]
    found_rows = []
    for name, gen in generators(dataset):
        found = digest(gen.get_state()) in held
        detail = "" if found else "its state (get_state()) is not in the file"
        found_rows.append({"kind": "stream_rng", "name": name, "saved": found, "detail": detail})
    return found_rows
