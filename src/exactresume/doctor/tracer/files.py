"""The paths a traced process writes, whatever writes them, and copies of what was there before.

`open()`/`io.open` in a writing mode, `os.open` with a writing flag, `os.mkdir` (and so
`os.makedirs` and `Path.mkdir`), a rename's target, `torch.save`, safetensors and DCP saves all
report a path here once: a `wrote` event says whether the path is new (it did not exist before the
write). A path that was there before this process and that it is about to change, replace or
delete (`os.remove`, `os.unlink`, `os.rmdir`, `shutil.rmtree`) is first copied into the keep
folder (a `kept` event), so that the doctor can put it back; not a path that one of the doctor's
earlier runs made (EXACTRESUME_DOCTOR_MADE lists those). Writes into the doctor's own folder are not
reported, nor writes to anything but a regular file, a folder or a symbolic link (`/dev/null`, a
FIFO, a socket; anything under /dev, /proc or /sys): the doctor moves and copies the paths reported,
and a device moved and put back comes back as an empty regular file.
"""

from __future__ import annotations

import os
import shutil
import stat
import time

WRITING_MODES = frozenset("wax+")
WRITING_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
# os.open(FOLDER, O_TMPFILE | ...) makes a file without a name in FOLDER (tempfile.TemporaryFile does,
# on Linux): no path is written, and the folder is not the process's to copy.
UNNAMED = getattr(os, "O_TMPFILE", 0)
SYSTEM = ("/dev", "/proc", "/sys")  # the kernel's trees: nothing there is a run's output


def ordinary(path: str) -> bool:
    """A regular file, a folder or a symbolic link (or nothing yet) outside /dev, /proc and /sys, by its
    own path and by the path it resolves to (/dev/stdout is a link into /proc)."""
    for where in (path, os.path.realpath(path)):
        if any(where == root or where.startswith(root + os.sep) for root in SYSTEM):
            return False
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return True  # not there: what a write makes of it is a regular file or a folder
    return stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)


def specials(folder: str, names: list[str]) -> list[str]:
    """The entries of `folder` a copy leaves out (copytree's ignore): FIFOs, sockets, devices."""
    return [name for name in names if not ordinary(os.path.join(folder, name))]


class Files:
    """What one process wrote, and the copies it kept; `write(record)` appends to its trace."""

    def __init__(self, write, keep: str | None, ignore: str | None):
        self.write, self.keep = write, keep
        self.ignore = os.path.abspath(ignore) + os.sep if ignore else None
        self.made: tuple[str, ...] = ()  # folders and files the doctor's earlier runs made: no copy of them
        self.seen: set[str] = set()
        self.busy = 0  # > 0 while the tracer copies a file itself

    def path_of(self, path) -> str | None:
        """An absolute path for a path-like argument; None for a file descriptor, or a path of the doctor's."""
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str | os.PathLike) or self.busy:
            return None
        path = os.path.abspath(path)
        return None if self.ignore and path.startswith(self.ignore) else path

    def before_write(self, path) -> None:
        """Report `path` the first time this process writes it; copy it first when it was there before."""
        path = self.path_of(path)
        if path is None or path in self.seen:
            return
        self.seen.add(path)
        if not ordinary(path):
            return
        existed = os.path.lexists(path)
        if existed:
            self.keep_copy(path)
        self.write({"event": "wrote", "path": path, "new": not existed})

    def created(self, path) -> None:
        """A folder this process has just made."""
        path = self.path_of(path)
        if path is not None and path not in self.seen:
            self.seen.add(path)
            if ordinary(path):
                self.write({"event": "wrote", "path": path, "new": True})

    def before_delete(self, path) -> None:
        """A path this process did not write, about to be deleted: keep a copy first."""
        path = self.path_of(path)
        if path is None or path in self.seen or not os.path.lexists(path):
            return
        self.seen.add(path)
        if not ordinary(path):
            return
        self.keep_copy(path)
        self.write({"event": "wrote", "path": path, "new": False})

    def keep_copy(self, path: str) -> None:
        if not self.keep or os.path.join(path, "").startswith(self.made):
            return
        if os.path.join(self.keep, "").startswith(os.path.join(path, "")):
            return  # a folder that holds the keep folder would be copied into itself
        copy = os.path.join(self.keep, f"{os.getpid()}-{len(self.seen):04d}-{os.path.basename(path)}")
        self.busy += 1
        try:
            os.makedirs(self.keep, exist_ok=True)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.copytree(path, copy, symlinks=True, ignore=specials)
            else:
                shutil.copy2(path, copy, follow_symlinks=False)
        finally:
            self.busy -= 1
        self.write({"event": "kept", "path": path, "copy": copy, "t": time.time_ns()})


def opening(files: Files, original):
    def traced(file, mode="r", *args, **kwargs):
        # With an opener, the path is the opener's to open (os.open, traced below, sees its flags).
        opener = kwargs.get("opener", args[5] if len(args) > 5 else None)
        if not isinstance(file, int) and opener is None and WRITING_MODES.intersection(mode):
            files.before_write(file)
        return original(file, mode, *args, **kwargs)

    return traced


def _os_opening(files: Files, original):
    def traced(path, flags, *args, **kwargs):
        unnamed = UNNAMED and (flags & UNNAMED) == UNNAMED
        if flags & WRITING_FLAGS and not unnamed and kwargs.get("dir_fd") is None:
            files.before_write(path)
        return original(path, flags, *args, **kwargs)

    return traced


def _making_folder(files: Files, original):
    def traced(path, *args, **kwargs):
        result = original(path, *args, **kwargs)  # raises when it is there already: not ours then
        if kwargs.get("dir_fd") is None:
            files.created(path)
        return result

    return traced


def deleting(files: Files, original):
    def traced(path, *args, **kwargs):
        if kwargs.get("dir_fd") is None:
            files.before_delete(path)
        return original(path, *args, **kwargs)

    return traced


def wrap_writes(files: Files, replace) -> None:
    """Wrap every writer of files named above through `replace(owner, name, make_wrapper)`."""
    import builtins
    import io

    replace(builtins, "open", lambda original: opening(files, original))
    replace(io, "open", lambda original: opening(files, original))
    replace(os, "open", lambda original: _os_opening(files, original))
    replace(os, "mkdir", lambda original: _making_folder(files, original))
    for name in ("remove", "unlink", "rmdir"):
        replace(os, name, lambda original: deleting(files, original))
    replace(shutil, "rmtree", lambda original: deleting(files, original))
