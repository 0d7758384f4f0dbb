"""A failed save's advice follows its cause: only a full disk is told to free space."""

from __future__ import annotations

import errno

import pytest

from exactresume.errors import ReadBackError
from exactresume.training.advice import advice


@pytest.mark.parametrize(
    "error, needle",
    [
        (OSError(errno.ENOSPC, "No space left on device"), "the disk is full: free space"),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), "quota"),
        (OSError(errno.EIO, "Input/output error"), "I/O error: check the device"),
        (OSError(errno.ENOENT, "No such file or directory"), "vanished during the save"),
        (OSError(errno.EROFS, "Read-only file system"), "read-only"),
        (ReadBackError(errno.EIO, "the checkpoint read back damaged"), "read back differs from what was written"),
        (OSError(errno.EBADF, "Bad file descriptor"), "fix the cause"),
    ],
)
def test_each_cause_has_its_own_advice(error, needle):
    text = advice(error)
    assert needle in text and text.endswith("--resume auto")
    assert ("free space" in text) == (error.errno in (errno.ENOSPC, errno.EDQUOT))
