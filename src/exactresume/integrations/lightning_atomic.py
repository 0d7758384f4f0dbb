"""Lightning's checkpoint writes, made atomic: a process killed while it writes one leaves the last good
checkpoint as it was, never half a `last.ckpt` that `fit(ckpt_path="last")` would then fail on.

Lightning's own writer opens the checkpoint's path and writes into it. The callback puts this writer
around it (for paths on the local disk): the same writer, given `PATH.tmp`, then the file made durable
and renamed over PATH, and the folder made durable (exactresume.atomic). Loading and removing go
to the writer as they were.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from exactresume.atomic import fsync_path, tmp_path

_CLASSES: dict[type, type] = {}


def atomic_io(io) -> Any:
    """`io` (the strategy's CheckpointIO) behind an atomic writer of the same kind; `io` if it is one already."""
    if isinstance(io, _Atomic):
        return io
    base = next((kind for kind in type(io).__mro__ if kind.__name__ == "CheckpointIO"), object)
    if base not in _CLASSES:
        _CLASSES[base] = type("AtomicCheckpointIO", (_Atomic, base), {})
    return _CLASSES[base](io)


class _Atomic:
    def __init__(self, inner):
        self.inner = inner

    def save_checkpoint(self, checkpoint: dict, path, storage_options: Any = None) -> None:
        if "://" in str(path):  # a remote filesystem: its own writer's guarantees
            self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        path = Path(path)
        tmp = tmp_path(path)
        try:
            self.inner.save_checkpoint(checkpoint, tmp, storage_options=storage_options)
            with open(tmp, "rb") as written:
                os.fsync(written.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
        fsync_path(path.parent)

    def load_checkpoint(self, *args, **kwargs):
        return self.inner.load_checkpoint(*args, **kwargs)

    def remove_checkpoint(self, path) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        teardown = getattr(self.inner, "teardown", None)
        if teardown is not None:
            teardown()

    def __getattr__(self, name: str):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
