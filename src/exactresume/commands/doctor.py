"""`exactresume doctor`: its flags, the Plan they make, and the verdict on the terminal (doctor/session.py runs it).

    exactresume doctor --steps 8 --stop-after 4 --resume-args "--resume" -- python train.py --out ckpt

Exit 0 when the resume is exact, 1 when it diverges (or the script is not deterministic even without
a resume), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from exactresume.atomic import ensure_writable_folder
from exactresume.commands.places import given_path
from exactresume.errors import UserError

DOCTOR_HELP = (
    "run your own training script straight, interrupted and resumed; name the state its resume loses",
    "exactresume doctor --steps 40 --stop-after 20 --resume-args '--from_resume 1' -- python train.py",
)


def add_flags(doctor: argparse.ArgumentParser) -> None:
    """The doctor's flags."""
    doctor.add_argument("--steps", type=int, required=True, metavar="N", help="optimizer steps to compare (1..N)")
    doctor.add_argument(
        "--stop-after",
        type=int,
        required=True,
        metavar="K",
        help="interrupt right after the first checkpoint the script saves at or after step K",
    )
    doctor.add_argument(
        "--resume-args", default="", metavar="ARGS", help="arguments added to COMMAND to resume, e.g. '--from_resume 1'"
    )
    doctor.add_argument(
        "--out",
        type=given_path,
        default=Path("doctor"),
        help="folder for doctor.json, report.md, verdict.txt, traces, logs, the files moved aside",
    )
    doctor.add_argument("--timeout", type=float, metavar="S", help="give up on a run after S seconds")
    doctor.add_argument(
        "--warm",
        action="store_true",
        help="fork each run of `python SCRIPT` from one process that imported torch once (seconds less per run)",
    )
    doctor.add_argument(
        "--preload",
        action="append",
        metavar="M,M",
        help="modules that process imports too, e.g. transformers,accelerate: their seconds paid once (implies --warm)",
    )
    doctor.add_argument(
        "user_command", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="your training command, after --"
    )
    parse = doctor.parse_known_args
    doctor.parse_known_args = lambda args=None, namespace=None: parse(_joined_resume_args(args), namespace)


def _joined_resume_args(args: list[str] | None) -> list[str] | None:
    """`--resume-args --resume` as typed: argparse would take `--resume` for a flag and refuse, so a value
    that starts with '-' is joined to it."""
    if args is None:
        return None
    args = list(args)
    end = args.index("--") if "--" in args else len(args)
    for index in range(end - 1):
        if args[index] == "--resume-args" and args[index + 1].startswith("-") and args[index + 1] != "--":
            args[index : index + 2] = [f"--resume-args={args[index + 1]}"]
            break
    return args


def _plan_from(args: argparse.Namespace):
    from exactresume.doctor.examine import Plan, module_names

    command = args.user_command[1:] if args.user_command[:1] == ["--"] else args.user_command
    if not command:
        raise UserError("give the training command after --, e.g. -- python train.py")
    if "--" in command and args.user_command[:1] != ["--"]:
        stray = " ".join(command[: command.index("--")])
        raise UserError(
            f"unexpected {stray!r} before --: --resume-args takes one word as typed; "
            f"write --resume-args='{args.resume_args} {stray}' for more"
        )
    try:
        resume_args = shlex.split(args.resume_args)
    except ValueError as error:
        raise UserError(f"--resume-args: {error}") from None
    if args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out {args.out} is a file, not a folder")
    preload = module_names(",".join(args.preload or []))  # given more than once: every one's modules
    if args.preload is not None and not all(map(module_names, args.preload)):
        raise UserError("--preload names no module: give them, e.g. --preload transformers,accelerate")
    plan = Plan(command, resume_args, args.steps, args.stop_after, args.out.resolve(), args.timeout, args.warm, preload)
    ensure_writable_folder(args.out)
    return plan


def run(args: argparse.Namespace) -> int:
    from exactresume.doctor.check import lab_installed
    from exactresume.doctor.session import run_doctor

    lab_installed()

    diagnosis, text = run_doctor(_plan_from(args))
    print(text)
    return diagnosis.exit_code
