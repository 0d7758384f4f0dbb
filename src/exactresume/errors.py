"""The exception types for users' mistakes and for a disk that refuses a write.

The CLI prints a `UserError` as one line on stderr and exits with its `exit_code` (2; 74 for a
`StorageError`); any other exception is a bug in exactresume and keeps its traceback.
"""


class UserError(Exception):
    """A mistake in what the user gave us (a flag, a file, a folder), explained in one line."""

    exit_code = 2


class CheckpointError(UserError):
    """A checkpoint file that cannot be trusted or does not fit the run."""


class StorageError(UserError):
    """A write failed (disk full, I/O error); what was written before it is intact."""

    exit_code = 74  # sysexits.h EX_IOERR: a scheduler can tell "free space and retry" from bad input


class ReadBackError(OSError):
    """A file that was written and fsynced but did not read back as written (errno EIO)."""
