"""The files between the doctor's runs: what the straight run left is moved aside, and put back at the end.

A run's *roots* are the topmost paths it wrote that are there when it ends: a folder it made (with
everything in it, whatever wrote it), or a file it wrote in a folder that was there before. The
straight run's roots go to OUT/files/straight before the interrupted run, so that the resume can
only find the interrupted run's checkpoint; at the end the interrupted and resumed runs' roots go to
OUT/files/resumed and the straight run's come back. A path that was there before the doctor and that
a run changed, replaced or deleted was copied to OUT/files/before/RUN first (the tracer's `kept`):
its original is put back after every run, so each run starts from what the user had, and is what
stays at the end (the straight run's version of it stays in OUT/files/straight). OUT/files/moved.json
lists each move before it is made; OUT/files/moves.json lists them all once done.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from exactresume.doctor.run import TracedRun

CACHES = ("XDG_CACHE_HOME", "HF_HOME", "TORCH_HOME", "MPLCONFIGDIR", "TRITON_CACHE_DIR")


def left_alone(path: str) -> bool:
    """Caches, the Python installation, and temporary files: not the script's output."""
    if "__pycache__" in Path(path).parts:
        return True
    homes = [os.environ.get(name) for name in CACHES] + [str(Path.home() / ".cache"), sys.prefix]
    if any(home and (path + os.sep).startswith(os.path.abspath(home) + os.sep) for home in homes):
        return True
    folder, name = os.path.split(path)
    return folder == os.path.abspath(tempfile.gettempdir()) and name.startswith(("tmp", "torchelastic_"))


def merged(runs: list[TracedRun]) -> dict[str, bool]:
    """Every path the runs wrote -> whether the first run to write it made it."""
    wrote: dict[str, bool] = {}
    for run in runs:
        for path, new in run.wrote.items():
            wrote.setdefault(path, new)
    return wrote


def roots(runs: list[TracedRun]) -> list[str]:
    """The topmost paths the runs made or changed that are there now, the shortest first."""
    wrote = merged(runs)
    made = {path for path, new in wrote.items() if new}
    found = set()
    for path in wrote:
        if not os.path.lexists(path):
            continue
        while os.path.dirname(path) in made:
            path = os.path.dirname(path)
        if not left_alone(path):
            found.add(path)
    return outermost(found)


def outermost(paths) -> list[str]:
    """The paths not inside another of them, the shortest first."""
    kept: list[str] = []
    for path in sorted(paths, key=len):
        if not any((path + os.sep).startswith(other + os.sep) for other in kept):
            kept.append(path)
    return kept


def originals(runs: list[TracedRun]) -> dict[str, str]:
    """Each path that was there before the doctor -> the copy of it kept first; a copy a later run
    kept of a path an earlier run wrote is not an original."""
    found: dict[str, str] = {}
    written: set[str] = set()
    for run in runs:
        for path, copy in run.kept.items():
            if path not in found and path not in written:
                found[path] = copy
        written |= {path for path, new in run.wrote.items() if new}
    return {path: found[path] for path in outermost(found)}


class Ledger:
    """OUT/files/moved.json: every move planned, written before it is made."""

    def __init__(self, out: Path):
        self.folder = out / "files"
        self.path = self.folder / "moved.json"
        self.moves: list[dict] = []

    def move(self, source: str, target: str, **facts) -> dict:
        move = {"from": source, "to": target} | facts
        self.moves.append(move)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.moves, indent=1))
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(source, target)
        return move

    def done(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "moves.json").write_text(json.dumps(self.moves, indent=1))
        self.path.unlink(missing_ok=True)


def set_aside(ledger: Ledger, straight: TracedRun) -> list[dict]:
    """The straight run's roots into OUT/files/straight; the originals it changed back in place."""
    folder = ledger.folder / "straight"
    before = originals([straight])
    paths = outermost(roots([straight]) + [p for p in before if os.path.lexists(p)])
    moves = [ledger.move(p, str(folder / f"{i:03d}-{Path(p).name}"), run="straight") for i, p in enumerate(paths)]
    for path, copy in before.items():
        copy_back(copy, path)
    return moves


def put_back(ledger: Ledger, straight: TracedRun, aside: list[dict], runs: list[TracedRun]) -> list[dict]:
    """The doctor's runs' roots into OUT/files/resumed, every original in place, the straight run's roots back.

    Returns the moves of the doctor's runs' files and of the originals."""
    folder = ledger.folder / "resumed"
    before = originals([straight, *runs])
    paths = outermost(roots(runs) + [p for p in before if os.path.lexists(p)])
    moves = [ledger.move(p, str(folder / f"{i:03d}-{Path(p).name}"), run="resumed") for i, p in enumerate(paths)]
    for path, copy in before.items():
        moves.append(ledger.move(copy, path, restored="was there before the doctor"))
    for move in aside:
        if not any((move["from"] + os.sep).startswith(p + os.sep) for p in before):
            ledger.move(move["to"], move["from"], run="straight, put back")
    ledger.done()
    return moves


def copy_back(copy: str, path: str) -> None:
    """A copy of an original in its place again, for the next run (the copy stays for the end)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if os.path.isdir(copy) and not os.path.islink(copy):
        shutil.copytree(copy, path, symlinks=True)
    else:
        shutil.copy2(copy, path, follow_symlinks=False)
