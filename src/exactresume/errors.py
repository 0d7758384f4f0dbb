"""The one exception type for users' mistakes.

The CLI prints a `UserError` as one line on stderr and exits with code 2; any other exception is a
bug in exactresume and keeps its traceback.
"""


class UserError(Exception):
    """A mistake in what the user gave us (a flag, a file, a folder), explained in one line."""


class CheckpointError(UserError):
    """A checkpoint file that cannot be trusted or does not fit the run."""
