"""Whether what is already in the place of a run's output is of that output's kind.

A run writes over an earlier run's weights, log or resume file only when told (`--resume`, which
continues them, or `--overwrite`); over a file of another kind never: a `--weights` that names the
corpus's token file, say, is refused whatever the flags, before anything is written.
"""

from __future__ import annotations

import os
from pathlib import Path

from exactresume.core.steplog import DIVERGENCE_HEADER, LOSS_HEADER, SAMPLES_HEADER
from exactresume.errors import UserError

LOG_HEADERS = {"--log": LOSS_HEADER, "--samples": SAMPLES_HEADER, "--divergence": DIVERGENCE_HEADER}


def within(path: Path, folder: Path) -> bool:
    """Whether `path` is `folder` or lies under it (links followed as far as they exist)."""
    inner, outer = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    return inner == outer or outer in inner.parents


def named_as_a_checkpoint(path: Path) -> bool:
    """Whether `path`, or a folder it lies in, has a name a store takes for its own (a checkpoint, one being
    written or set aside), in any store's folder: a store would write, prune or set it aside."""
    parts = Path(os.path.realpath(path)).parts
    if not any(part.startswith("step-") for part in parts):  # every such name begins so: no torch to import
        return False
    from exactresume.store.layout import is_store_name

    return any(is_store_name(part) for part in parts)


def refuse_other_kinds(outputs: dict[str, Path]) -> None:
    """One line for the first output (by its flag) whose place holds a file of another kind."""
    for flag, path in outputs.items():
        header = LOG_HEADERS.get(flag)  # None: a torch file (weights, resume file)
        if path.exists() and not _holds(path, header):
            from exactresume.store.sealed import first_bytes  # with torch: only where an output exists

            what = f"a log beginning {header}" if header else "a torch file"
            found = "it is a folder" if path.is_dir() else f"it begins {first_bytes(path, 16)!r}"
            raise UserError(
                f"{flag} {path} is not {what} ({found}): a run writes over an earlier run's outputs, never over "
                "a file of another kind; give another path"
            )


def _holds(path: Path, header: str | None) -> bool:
    # imported here, with torch, only where an output exists: a command refused before may not import it
    from exactresume.store.layout import COMMIT, SHARDED
    from exactresume.store.sealed import ZIP_START, first_bytes

    if path.is_dir():  # the one output that is a folder, a sharded resume file (resume.dcp): a commit marker, or empty
        return path.suffix == SHARDED.suffix and ((path / COMMIT).is_file() or not any(path.iterdir()))
    head = first_bytes(path, 64)
    if head == b"":
        return True
    if header is None:
        return head.startswith(ZIP_START)
    return head.split(b"\n", 1)[0].rstrip(b"\r") == header.encode()
