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

Only regular files, folders and symbolic links are moved or copied, never anything under /dev, /proc
or /sys (`ordinary`). Caches, the Python installation and the temp folder's contents stay where they
are (`_left_alone`), except where a run saved or loaded a checkpoint, or in a working folder that is
itself under the temp folder: what the resume reads must go aside, whichever folder holds it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from exactresume.doctor.run import TracedRun, read_run
from exactresume.doctor.tracer.files import ordinary

CACHES = ("XDG_CACHE_HOME", "HF_HOME", "TORCH_HOME", "MPLCONFIGDIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
# What tempfile.mkdtemp, torchrun, torch.compile and multiprocessing make in the temp folder.
SCRATCH = ("tmp", "torchelastic_", "torchinductor_", "pymp-")


def inside(path: str, folder: str) -> bool:
    return (path + os.sep).startswith(folder.rstrip(os.sep) + os.sep)


def _left_alone(path: str, checkpoints: list[str] = ()) -> bool:
    """Caches, the Python installation, and temporary files: not the script's output. `checkpoints`:
    the paths the runs saved or loaded checkpoints at and their folders (`_checkpoint_places`)."""
    if "__pycache__" in Path(path).parts:
        return True
    homes = [os.environ.get(name) for name in CACHES] + [sys.prefix]
    homes += [str(Path.home() / ".cache"), str(Path.home() / ".triton")]
    if any(home and inside(path, os.path.abspath(home)) for home in homes):
        return True
    temp = os.path.abspath(tempfile.gettempdir())
    if not inside(path, temp) or any(inside(path, place) or inside(place, path) for place in checkpoints):
        return False
    # A working folder inside the temp folder (a notebook's, a test's) holds the user's own files; what
    # tempfile, torchrun, torch.compile and multiprocessing leave at the temp folder's top does not.
    cwd = os.getcwd()
    top = os.path.relpath(path, temp).split(os.sep)[0]
    return top.startswith(SCRATCH) or cwd == temp or not inside(path, cwd)


def _checkpoint_places(runs: list[TracedRun]) -> list[str]:
    """Every path a run saved a checkpoint to or loaded one from, and the folder holding it (unless that
    is the temp folder or above it): a resume reads there, and what sits next to a checkpoint goes with it."""
    temp = os.path.abspath(tempfile.gettempdir())
    places = set()
    for run in runs:
        for path in [event["path"] for event in run.saves + run.loads if event.get("path")]:
            places.add(path)
            if not inside(temp, os.path.dirname(path)):
                places.add(os.path.dirname(path))
    return sorted(places)


def _the_runs(path: str, checkpoints: list[str]) -> bool:
    """A path the doctor may move: the run's output, a regular file, folder or link outside /dev, /proc, /sys."""
    return ordinary(path) and not _left_alone(path, checkpoints)


def _merged(runs: list[TracedRun]) -> dict[str, bool]:
    """Every path the runs wrote -> whether the first run to write it made it."""
    wrote: dict[str, bool] = {}
    for run in runs:
        for path, new in run.wrote.items():
            wrote.setdefault(path, new)
    return wrote


def roots(runs: list[TracedRun]) -> list[str]:
    """The topmost paths the runs made or changed that are there now, the shortest first."""
    wrote = _merged(runs)
    made = {path for path, new in wrote.items() if new}
    checkpoints = _checkpoint_places(runs)
    found = set()
    for path in wrote:
        if not os.path.lexists(path):
            continue
        while os.path.dirname(path) in made:
            path = os.path.dirname(path)
        if _the_runs(path, checkpoints):
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
    checkpoints = _checkpoint_places(runs)
    return {path: found[path] for path in outermost(p for p in found if _the_runs(p, checkpoints))}


class Ledger:
    """OUT/files/moved.json: every move planned, written before it is made."""

    def __init__(self, out: Path):
        self.folder = out / "files"
        self.path = self.folder / "moved.json"
        self.moves: list[dict] = []

    def move(self, source: str, target: str, **facts) -> dict:
        move = {"from": source, "to": target} | facts
        self.moves.append(move)
        if os.path.lexists(target):  # made before a doctor that was stopped (recover) could note it done,
            return move  # or a path already put back: never into it, never over it
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.moves, indent=1))
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(source, target)
        return move

    def move_into(self, paths: list[str], folder: Path, run: str) -> list[dict]:
        """Each path into `folder`, numbered in order (two paths may share a name)."""
        return [self.move(p, str(folder / f"{i:03d}-{Path(p).name}"), run=run) for i, p in enumerate(paths)]

    def done(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "moves.json").write_text(json.dumps(self.moves, indent=1))
        self.path.unlink(missing_ok=True)


def set_aside(ledger: Ledger, straight: TracedRun) -> list[dict]:
    """The straight run's roots into OUT/files/straight; the originals it changed back in place."""
    folder = ledger.folder / "straight"
    before = originals([straight])
    paths = outermost(roots([straight]) + [p for p in before if os.path.lexists(p)])
    moves = ledger.move_into(paths, folder, "straight")
    for path, copy in before.items():
        _copy_back(copy, path)
    return moves


def set_aside_earlier(ledger: Ledger, interrupted: TracedRun) -> list[dict]:
    """The checkpoints of an earlier run beside the interrupted run's into OUT/files/earlier, so that the
    resume finds the interrupted run's as it would in a fresh folder: in the folder (or the one above it,
    never the working folder or one above it) of each checkpoint the interrupted run saved, each entry
    named as the saved one's but for its numbers (checkpoint-12 beside checkpoint-4) that holds nothing
    the interrupted run wrote."""
    saved = [event["path"] for event in interrupted.saves if event.get("path")]
    wrote = [*saved, *interrupted.wrote]
    found = set()
    for path in saved:
        for entry in (path, os.path.dirname(path)):
            found |= set(_numbered_siblings(entry, wrote))
    # beside a checkpoint, so not left alone as the temp folder's scratch is (a cache still is)
    checkpoints = _checkpoint_places([interrupted]) + sorted({os.path.dirname(path) for path in found})
    earlier = [path for path in sorted(found) if _the_runs(path, checkpoints)]
    folder = ledger.folder / "earlier"
    return ledger.move_into(earlier, folder, "earlier")


def _numbered_siblings(entry: str, wrote: list[str]) -> list[str]:
    """The entries beside `entry` named as it is but for their numbers, of its kind, holding nothing written."""
    parent, pattern = os.path.dirname(entry), _numbered(os.path.basename(entry))
    if "#" not in pattern or inside(os.getcwd(), parent) or not os.path.isdir(parent):
        return []
    siblings = [os.path.join(parent, name) for name in os.listdir(parent) if _numbered(name) == pattern]
    return [
        sibling
        for sibling in siblings
        if os.path.isdir(sibling) == os.path.isdir(entry) and not any(inside(path, sibling) for path in wrote)
    ]


def _numbered(name: str) -> str:
    return re.sub(r"[0-9]+", "#", name)


def put_back(
    ledger: Ledger,
    straight: TracedRun,
    aside: list[dict],
    runs: list[TracedRun],
    earlier: list[dict] = (),
    into: str = "resumed",
) -> list[dict]:
    """The doctor's runs' roots into OUT/files/resumed, every original in place (an earlier run's
    checkpoints set aside for the resume too), the straight run's roots back where no original is.

    Returns the moves of the doctor's runs' files, of the originals and of the straight run's roots."""
    folder = ledger.folder / into
    before = originals([straight, *runs])
    done = [path for path, copy in before.items() if not os.path.lexists(copy)]  # by a doctor stopped since
    before = {path: copy for path, copy in before.items() if path not in done}
    made = [path for path in roots(runs) if not any(inside(path, original) for original in done)]
    paths = outermost(made + [p for p in before if os.path.lexists(p)])
    moves = ledger.move_into(paths, folder, "resumed")
    for path, copy in before.items():
        moves.append(ledger.move(copy, path, restored="was there before the doctor"))
    for move in earlier:  # where the straight run had changed it too, its original is back already
        if not any(inside(move["from"], path) or inside(path, move["from"]) for path in before):
            moves.append(ledger.move(move["to"], move["from"], restored="an earlier run's, set aside for the resume"))
    kept = [*before, *(move["from"] for move in earlier)]
    # A folder that holds files of yours the runs changed (a checkpoint folder of your own run) gets
    # back only yours: a file the straight run added beside them would mix two runs in one checkpoint.
    yours = {os.path.dirname(path) for path in before}
    for move in aside:
        if not any(inside(move["from"], p) for p in kept) and os.path.dirname(move["from"]) not in yours:
            moves.append(ledger.move(move["to"], move["from"], run="straight, put back"))
    ledger.done()
    return moves


def _copy_back(copy: str, path: str) -> None:
    """A copy of an original in its place again, for the next run (the copy stays for the end)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if os.path.isdir(copy) and not os.path.islink(copy):
        shutil.copytree(copy, path, symlinks=True)
    else:
        shutil.copy2(copy, path, follow_symlinks=False)


def unfinished(out: Path) -> bool:
    """Whether a doctor into OUT stopped before it put back what its runs moved (kill -9, a power cut)."""
    ledger = Ledger(out)
    return ledger.path.exists() or ((out / "traces").is_dir() and not (ledger.folder / "moves.json").exists())


def recover(out: Path) -> list[dict]:
    """What the runs of a doctor into OUT that stopped before its end moved or changed, put back from
    their traces: every original in place, an earlier run's checkpoints back, the runs' own files (the
    straight run's too) into OUT/files/stopped. Returns the moves."""
    runs = [run for name in ("straight", "interrupted", "resumed") if (run := read_run(name, out))]
    ledger = Ledger(out)
    planned = json.loads(ledger.path.read_text()) if ledger.path.exists() else []
    ledger.moves = list(planned)
    earlier = [move for move in planned if move.get("run") == "earlier" and os.path.lexists(move["to"])]
    if not runs:
        ledger.done()
        return []
    return put_back(ledger, runs[0], [], runs, earlier, into="stopped")
