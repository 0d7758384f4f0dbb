"""What to do after a save failed, by its cause: only a full disk is told to free space.

    advice(OSError(errno.ENOSPC, ...))  ->  "free space, then rerun with --resume auto"

A write error names its errno (StorageError.from_os_error); this adds the one next step that fits it.
"""

from __future__ import annotations

import errno

from exactresume.errors import ReadBackError

RERUN = "rerun with --resume auto"

BY_ERRNO = {
    errno.ENOSPC: f"the disk is full: free space, then {RERUN}",
    errno.EDQUOT: f"the disk quota is used up: free space or raise the quota, then {RERUN}",
    errno.EIO: f"the storage reported an I/O error: check the device or move --out elsewhere, then {RERUN}",
    errno.ENOENT: (
        "a file or folder vanished during the save: is another process or a cleanup job deleting files "
        f"in the folder? Stop it, then {RERUN}"
    ),
    errno.EROFS: f"the file system became read-only: remount it or move --out elsewhere, then {RERUN}",
    errno.EACCES: f"permission denied: make the folder writable, then {RERUN}",
    errno.EPERM: f"the operation was not permitted: make the folder writable, then {RERUN}",
    errno.EFBIG: f"a file grew beyond what this process may write (ulimit -f): raise the limit, then {RERUN}",
}


def advice(error: BaseException) -> str:
    """The next step after `error` stopped a save."""
    if isinstance(error, ReadBackError):
        return (
            "the file read back differs from what was written, so the storage returned bad data: "
            f"check the disk or file system before you {RERUN}"
        )
    code = getattr(error, "errno", None)
    return BY_ERRNO.get(code, f"fix the cause, then {RERUN}")
