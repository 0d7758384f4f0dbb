"""Where a command reads and writes: --data, and `s3://` locations with the flags that reach them.

An `s3://` value stays text while the flags are parsed (its --s3-endpoint may come later on the
line); `place` makes it a location once every flag is known. Credentials come from the AWS chain.
"""

from __future__ import annotations

import argparse
import difflib
import os
from pathlib import Path

DEFAULT_DATA = Path("data/kjv")


def add_data_flag(group) -> None:
    group.add_argument(
        "--data", type=given_path, default=DEFAULT_DATA, help="prepared data folder (exactresume prepare)"
    )


def add_s3_flags(group, uploads: bool = False) -> None:
    """--s3-endpoint, --s3-tries, --s3-timeout, and with `uploads` --s3-part-mib: how an s3:// location is
    reached (a command that only reads, inspect and diff, uploads nothing)."""
    from exactresume.store.locations import CONNECT_SECONDS, DEFAULT_TRIES, PART_BYTES, READ_SECONDS

    group.add_argument(
        "--s3-endpoint",
        metavar="URL",
        help="an S3-compatible server, http(s)://host:port (default AWS_ENDPOINT_URL, else AWS itself)",
    )
    group.add_argument(
        "--s3-tries",
        type=int,
        default=DEFAULT_TRIES,
        metavar="N",
        help="tries of each S3 request, with backoff, before stopping",
    )
    group.add_argument(
        "--s3-timeout",
        type=float,
        default=READ_SECONDS,
        metavar="SECONDS",
        help=f"how long one try waits for the server's answer (to connect: at most {CONNECT_SECONDS:g} s)",
    )
    if not uploads:
        return
    group.add_argument(
        "--s3-part-mib",
        type=int,
        default=PART_BYTES >> 20,
        metavar="MIB",
        help="larger files go up in parts this size (min 5)",
    )


def _s3_config(args: argparse.Namespace):
    """How the command reaches an object store: --s3-endpoint (else AWS_ENDPOINT_URL), --s3-tries, --s3-timeout."""
    from exactresume.store.locations import CONNECT_SECONDS, PART_BYTES, S3Config

    timeouts = {"read_timeout": args.s3_timeout, "connect_timeout": min(CONNECT_SECONDS, args.s3_timeout)}
    part_mib = getattr(args, "s3_part_mib", None)  # a command that only reads has no such flag
    part_bytes = PART_BYTES if part_mib is None else part_mib << 20
    return S3Config(endpoint=args.s3_endpoint, tries=args.s3_tries, part_bytes=part_bytes, **timeouts)


def check_endpoint_used(args: argparse.Namespace, *values) -> None:
    """--s3-endpoint given where no value is an `s3://` location: said, not silently unused (a script may
    pass it to every run, so the run goes on)."""
    from exactresume.errors import notice
    from exactresume.store.locations import is_s3

    if args.s3_endpoint is not None and not any(is_s3(value) for value in values):
        notice(f"--s3-endpoint {args.s3_endpoint} is unused: no location of this command is s3://BUCKET/PREFIX")


def place(value, args: argparse.Namespace):
    """A flag's location: an `s3://` one reached as --s3-endpoint says, anything else a Path (or as it is)."""
    from exactresume.store.locations import is_s3, location

    return location(value, _s3_config(args)) if is_s3(value) else value


def resume_source(text: str) -> Path | str:
    """--resume's value: 'auto', an `s3://` location (made with --s3-endpoint later), or a file or folder;
    a path that is not there and is near 'auto' (`aut`, `Auto`) is taken for a typo of it, not read."""
    if text == "auto" or text.startswith("s3://"):
        return text
    if not os.path.lexists(text) and difflib.get_close_matches(text.lower(), ["auto"], n=1, cutoff=0.7):
        raise argparse.ArgumentTypeError(f"no file or folder {text} (did you mean auto?)")
    return given_path(text)


def given_path(text: str) -> Path:
    """A path flag's value; an empty one is refused (Path("") would be the current folder), and so is one
    that begins as a URL (`s3:/bucket`, `gs://bucket`), which would otherwise be a folder made here."""
    if not text:
        raise argparse.ArgumentTypeError("a path cannot be empty")
    from exactresume.store.locations import not_a_url

    if (why := not_a_url(text)) is not None:
        raise argparse.ArgumentTypeError(why)
    return Path(text)


def local_folder(text: str) -> Path:
    """A folder on this machine's disk (a local tier of checkpoints): an `s3://` location is refused."""
    if text.startswith("s3://"):
        raise argparse.ArgumentTypeError("a local tier is a folder on this machine's disk, not an s3:// location")
    return given_path(text)


def any_location(text: str) -> Path | str:
    """A path, or an `s3://` location (kept as text until --s3-endpoint is known)."""
    return text if text.startswith("s3://") else given_path(text)
