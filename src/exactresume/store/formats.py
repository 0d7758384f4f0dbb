"""What a path holds, told apart in one place, and the one format check every reader of our files makes.

    path_kind(path)      "missing", "sharded" (a DCP folder, --sharded), "folder" (any other folder:
                         a checkpoint store), "safetensors", or "torch" (any other file); from names
                         and a file's first bytes only
    content_kind(obj)    what a loaded torch object is: "resume", "weights" (a MiniMind state dict)
                         or "torch" (anything else)
    check_format(...)    a loaded dict is of our `format` and of a `version` this exactresume reads

`open_resume` (--resume), `read_weights` (load_model, diff, export) and `inspect` all start here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from exactresume.errors import CheckpointError
from exactresume.store.safetensors_weights import is_safetensors

RESUME_FORMAT = "exactresume.resume"
RESUME_VERSION = 3  # written: torch.save of the state itself, every part under its name
# Read: 1 is the same layout. A file of version 2 held the state packed into a few buffers (it is
# refused, naming the release that reads it); a sharded folder of version 2 holds the plain state.
RESUME_VERSIONS = (1, 2, 3)
PACKED_LAYOUT = "packed"  # the `layout` of a version 2 file
PACKED_RELEASE = "0.2.0"  # the release that wrote and reads it
MODEL_KEYS = ("model.embed_tokens.weight", "lm_head.weight")  # a MiniMind state dict holds one of these
CONTENT_NAMES = {"resume": "a resume file", "weights": "a weights file", "torch": "a torch file of another layout"}


def is_sharded_folder(path: Path) -> bool:
    """A folder holding DCP's files (its index, shards or our commit marker): a --sharded checkpoint."""
    path = Path(path)
    return path.is_dir() and (
        (path / ".metadata").exists() or any(path.glob("*.distcp")) or (path / "commit.pth").exists()
    )


def path_kind(path: Path) -> str:
    """What is at `path`, told from names and first bytes: nothing is loaded."""
    path = Path(path)
    if path.is_dir():
        return "sharded" if is_sharded_folder(path) else "folder"
    if not path.exists():
        return "missing"
    if not path.is_file():  # opening a pipe would wait for a writer
        raise CheckpointError(
            f"{path} is neither a file nor a folder (a pipe or a device): no checkpoint is read from it"
        )
    return "safetensors" if is_safetensors(path) else "torch"


def _is_model_state_dict(obj: object) -> bool:
    """A non-empty dict of tensors with MiniMind's key names."""
    return (
        isinstance(obj, dict)
        and bool(obj)
        and all(isinstance(value, torch.Tensor) for value in obj.values())
        and any(key in obj for key in MODEL_KEYS)
    )


def content_kind(obj: object) -> str:
    """ "resume", "weights" or "torch": what a loaded torch object is."""
    if isinstance(obj, dict) and obj.get("format") == RESUME_FORMAT:
        return "resume"
    return "weights" if _is_model_state_dict(obj) else "torch"


def check_format(path: Path, state: object, format: str, version: int | tuple[int, ...], what: str) -> dict:
    """`state` if it is a dict of `format` at `version` (or one of them), else CheckpointError naming what it is."""
    if not isinstance(state, dict) or state.get("format") != format:
        raise CheckpointError(f"{path}: {CONTENT_NAMES[content_kind(state)]}, not {what}")
    if state.get("layout") == PACKED_LAYOUT:
        raise CheckpointError(
            f"{path}: {format} version {state.get('version')} in the packed layout, which exactresume "
            f"{PACKED_RELEASE} wrote and reads; this exactresume reads the plain layout of versions 1 and 3"
        )
    versions = version if isinstance(version, tuple) else (version,)
    if state.get("version") not in versions:
        readable = "version " + " and ".join(str(number) for number in versions)
        raise CheckpointError(f"{path}: {format} version {state.get('version')}; this exactresume reads {readable}")
    return state
