"""The `exactresume` command: it registers its subcommands (commands/, one module each) and runs one.

    exactresume                      the commands, one line and an example each (also `exactresume help`)
    exactresume help train           one command's flags, grouped
    exactresume --version

A subcommand is a row of COMMANDS and of PARSERS: the module that adds its flags and runs it. The
run's flags of train, lab and ablate are made from TrainConfig's fields (commands/config_flags.py),
in the --help groups of its GROUPS.

A user's mistake prints one line on stderr and exits with code 2; a disk that refuses a write exits
with 74, a run stopped by SIGTERM/SIGINT after saving a checkpoint with 75 (see training/job.py).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import signal
import sys
import textwrap

from exactresume import __version__
from exactresume.commands import ablate, diff, doctor, export, inspection, lab, prepare, train
from exactresume.commands.output import summary_stdout
from exactresume.errors import FieldError, UserError, extras_needed
from exactresume.world import launched_by_torchrun

# name -> (what it does, in one line; an example)
COMMANDS = {
    "prepare": ("corpus -> tokenizer, train.npy, val.npy (cached)", "exactresume prepare --out data/kjv"),
    "train": ("train, stop with a resume file, resume", "exactresume train --out runs/a --stop-at 30"),
    "lab": ("the whole lab: straight, stop, resume, ablations, fp16, report", "exactresume lab --out runs/lab"),
    "ablate": ("resume with each part of the resume file lost in turn, measured", "exactresume ablate --out runs/ab"),
    "diff": ("the model weights of two files or folders, compared bit for bit", "exactresume diff a.pth b.pth"),
    "inspect": ("what a checkpoint is: kind, step, config, parts, sizes", "exactresume inspect runs/a/resume.pth"),
    "export": ("inference weights in fp16/bf16/fp32, .pt or .safetensors", "exactresume export r.pth -o m.safetensors"),
    "doctor": doctor.DOCTOR_HELP,
    "help": ("these commands, or one command's flags", "exactresume help train"),
}


class WrappedAtSpaces(argparse.HelpFormatter):
    """argparse's help, its lines broken at spaces only: a flag quoted in a help text ('--from_resume 1')
    is not cut after its dashes, as textwrap cuts at hyphens by default."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines = textwrap.wrap(" ".join(text.split()), width - len(indent), break_on_hyphens=False)
        return "\n".join(indent + line for line in lines)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (no usage dump) and exit code 2, and a flag is typed
    whole: an abbreviation that names one flag today would name another, or none, once a flag is added."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"allow_abbrev": False, "formatter_class": WrappedAtSpaces} | kwargs)

    def error(self, message: str) -> None:
        print(f"{self.prog}: error: {message}{self._flag_hint(message)}{_choice_hint(message)}", file=sys.stderr)
        sys.exit(2)

    def _flag_hint(self, message: str) -> str:
        """For a flag refused as shortened: the flags it begins; as mistyped (`--stop_at`): the one it is near."""
        if not message.startswith("unrecognized arguments: "):
            return ""
        known = [option for action in self._actions for option in action.option_strings]
        for word in message.removeprefix("unrecognized arguments: ").split():
            name = word.split("=", 1)[0]
            begun = [option for option in known if name.startswith("--") and option.startswith(name)]
            if len(begun) > 3:
                return f" (flags are typed whole: {len(begun)} begin with {name}, see {self.prog} --help)"
            if begun:
                return f" (flags are typed whole: {' or '.join(begun)}?)"
            near = difflib.get_close_matches(name, known, n=1, cutoff=NEAR) if name.startswith("--") else []
            if near:
                return f" (did you mean {near[0]}?)"
        return ""


NEAR = 0.8  # difflib's similarity from which a mistyped name is taken for the one it is near (--stop_at, tran)


def _choice_hint(message: str) -> str:
    """For a value refused as no choice (a command, a --dtype): the choice it is near."""
    refused = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
    if not refused:
        return ""
    choices = {choice.lower(): choice for choice in re.findall(r"'([^']*)'", refused[2])}  # FP16, Tiny: near too
    near = difflib.get_close_matches(refused[1].lower(), choices, n=1, cutoff=NEAR)
    return f" (did you mean {choices[near[0]]}?)" if near else ""


def _help_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("topic", nargs="?", choices=[name for name in COMMANDS if name != "help"], metavar="COMMAND")


# name -> (add its flags, run it): one module of commands/ each
PARSERS = {
    "prepare": (prepare.add_flags, prepare.run),
    "train": (train.add_flags, train.run),
    "lab": (lab.add_flags, lab.run),
    "ablate": (ablate.add_flags, ablate.run),
    "diff": (diff.add_flags, diff.run),
    "inspect": (inspection.add_flags, inspection.run),
    "export": (export.add_flags, export.run),
    "doctor": (doctor.add_flags, doctor.run),
    "help": (_help_parser, None),
}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="exactresume", description="Stop and resume training bit-for-bit.")
    parser.add_argument("--version", action="version", version=f"exactresume {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (add_flags, run) in PARSERS.items():
        what, example = COMMANDS[name]
        command = subparsers.add_parser(name, help=what, description=f"{what}.", epilog=f"example: {example}")
        add_flags(command)
        command.set_defaults(func=run)
    return parser


def _command_list() -> str:
    """What `exactresume` alone and `exactresume help` print."""
    width = max(map(len, COMMANDS))
    lines = [f"exactresume {__version__}: stop and resume training bit-for-bit.", "", "commands:"]
    for name, (what, example) in COMMANDS.items():
        lines += [f"  {name.ljust(width)}  {what}", f"  {''.ljust(width)}    {example}"]
    lines += ["", "`exactresume help COMMAND` (or `exactresume COMMAND --help`) shows a command's flags."]
    return "\n".join(lines)


def _show_help(parser: argparse.ArgumentParser, topic: str | None) -> int:
    if topic is None:
        print(_command_list())
    else:
        _subparsers(parser).choices[topic].print_help()
    return 0


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))


def main(argv: list[str] | None = None) -> int:
    """`exactresume ARGV`: its exit code."""
    try:
        return _run(sys.argv[1:] if argv is None else list(argv))
    except BrokenPipeError:  # what read our stdout left (`| head`): end as SIGPIPE ends a program, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush goes nowhere
        return 128 + signal.SIGPIPE


def _run(argv: list[str]) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's own parser, whose name the user typed
        _subparsers(parser).choices.get(args.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command in (None, "help"):
        return _show_help(parser, getattr(args, "topic", None))
    # What --nproc runs on each rank (this command, by this function), and what a stopped run's summary continues.
    args.argv, args.main = argv, main
    try:
        with summary_stdout(args), extras_needed():
            return args.func(args)
    except UserError as error:
        message = error.with_flags() if isinstance(error, FieldError) else str(error)  # the flags, not the fields
        print(f"exactresume {args.command}: error: {message}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print(f"exactresume {args.command}: interrupted", file=sys.stderr)
        return 130


def exit_as_rank(code: int) -> None:
    """End a torchrun rank once its command returned: every file is written and its process group gone.

    Interpreter teardown is skipped: there gloo's threads now and then abort a rank ("terminate
    called without an active exception", seen on 2 and 4 processes after a clean finish), which
    torchrun would report as a failed run.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_command_line() -> None:
    """`exactresume` on this process's arguments, exiting with its code (a torchrun rank: at once)."""
    exit_code = main()
    if launched_by_torchrun():
        exit_as_rank(exit_code)
    sys.exit(exit_code)


if __name__ == "__main__":
    run_command_line()
