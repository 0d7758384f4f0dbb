"""What each `exactresume` command does with its parsed flags (cli.py defines the flags).

Every command ends with `emit`: its closing summary (summaries.py) as aligned text, or with `--json`
as one JSON object on stdout. The heavy imports (torch) happen inside the commands, so `--help`
and a refused flag stay fast.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from collections.abc import Callable
from pathlib import Path

from exactresume import summaries
from exactresume.errors import UserError
from exactresume.flags import config_from_args
from exactresume.guards import check_plan, lock_out, remove_made_folder
from exactresume.progress import ByteProgress, mode_from_args


def emit(args: argparse.Namespace, summary: dict, render: Callable[[dict], list[str]], gap: bool = True) -> None:
    """The command's closing summary on the real stdout (main sends everything else elsewhere under --json)."""
    if getattr(args, "quiet", False) or getattr(args, "no_summary", False):
        return
    stream = getattr(args, "summary_stream", None) or sys.stdout
    if getattr(args, "json", False):
        print(json.dumps(summary, indent=2), file=stream, flush=True)
        return
    text = "\n".join(render(summary))
    print(("\n" if gap else "") + text, file=stream, flush=True)


def cmd_prepare(args: argparse.Namespace) -> int:
    from exactresume.core.data import PrepareConfig, prepare

    mode = mode_from_args(args)
    manifest = args.out / "manifest.json"
    before = manifest.stat() if manifest.exists() else None
    prepare(
        PrepareConfig(corpus=args.corpus, tokenizer=args.tokenizer, vocab_size=args.vocab_size),
        args.out,
        log=print if mode != "none" else lambda message: None,
        progress=ByteProgress("prepare: encode", mode),
    )
    after = manifest.stat()
    # A reused folder's manifest is the file that was there; a new one was renamed into place.
    reused = before is not None and (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)
    emit(args, summaries.prepare_summary(args.out, reused), summaries.render_prepare)
    return 0


def add_s3_flags(group) -> None:
    """--s3-endpoint, --s3-tries, --s3-timeout and --s3-part-mib: how an s3:// location is reached
    (credentials: the AWS chain)."""
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
    group.add_argument(
        "--s3-part-mib",
        type=int,
        default=PART_BYTES >> 20,
        metavar="MIB",
        help="larger files go up in parts this size (min 5)",
    )


def s3_config(args: argparse.Namespace):
    """How the command reaches an object store: --s3-endpoint (else AWS_ENDPOINT_URL), --s3-tries, --s3-timeout."""
    from exactresume.store.locations import CONNECT_SECONDS, S3Config

    timeouts = {"read_timeout": args.s3_timeout, "connect_timeout": min(CONNECT_SECONDS, args.s3_timeout)}
    return S3Config(endpoint=args.s3_endpoint, tries=args.s3_tries, part_bytes=args.s3_part_mib << 20, **timeouts)


def place(value, args: argparse.Namespace):
    """A flag's location: an `s3://` one reached as --s3-endpoint says, anything else a Path (or as it is)."""
    from exactresume.store.locations import is_s3, location

    return location(value, s3_config(args)) if is_s3(value) else value


def train_job(args: argparse.Namespace):
    """The job the flags describe (its config built once, here); making it imports no torch."""
    from exactresume.training.job import TrainJob

    skip = frozenset(name for flag, name in ((args.no_optim, "optimizer"), (args.no_skip, "gen_state")) if flag)
    return TrainJob(
        config_from_args(args),
        args.data,
        args.out,
        stop_at=args.stop_at,
        resume=place(args.resume, args),
        skip_parts=skip,
        weights=args.weights,
        log=args.log,
        samples=args.samples,
        save_every=args.save_every,
        keep=args.keep or None,
        allow_change=frozenset(args.allow_change),
        async_save=args.async_save,
        sharded=args.sharded,
        divergence=args.divergence,
        wait_lock=args.wait_lock,
        checkpoints=place(args.checkpoints, args) if args.checkpoints else None,
    )


def cmd_train(args: argparse.Namespace) -> int:
    from exactresume.world import World

    # The ranks of a torchrun launch share the folder its rank 0 (or the launching process) cleans up.
    made, code = not args.out.exists() and World.from_env().is_main, 1
    try:
        code = train_command(args)
    finally:
        if made and code != 0:
            remove_made_folder(args.out)
    return code


def train_command(args: argparse.Namespace) -> int:
    from exactresume.world import World, launched_by_torchrun

    argv = getattr(args, "argv", sys.argv[1:])  # main sets it; a caller of its own may not
    job, world = train_job(args), World.from_env()  # checked as it is made: before anything is written
    # The plan before torch is imported: a run that cannot fit is refused at once. torchrun's ranks
    # skip it, and the launch: their launching process checked the whole machine and started them.
    plan = None if launched_by_torchrun() else check_plan(job.config, args)
    if plan is not None and args.dry_run:
        return 0
    if plan is not None and args.nproc > 1:
        return launch_ranks(args, job, argv, plan)
    code = train_here(args, job, world)
    if code == 0 and world.is_main:
        emit(args, summaries.train_summary(job, argv, memory(plan, resource.RUSAGE_SELF)), summaries.render_train)
    return code


def memory(plan, who: int) -> dict | None:
    """The peak resident memory of the largest process of the run (this one, or its ranks), and the plan's."""
    if plan is None:
        return None
    return {"peak_bytes": resource.getrusage(who).ru_maxrss * 1024, "planned_bytes": plan.process_bytes}


def launch_ranks(args: argparse.Namespace, job, argv: list[str], plan) -> int:
    """`train --nproc N`: the same command in N processes (parallel.launch); this one sums up."""
    from exactresume.parallel.launch import launch
    from exactresume.parallel.split import check_split

    config = job.config
    check_split(config.batch, args.nproc, config.grad_accum, config.micro_batch)
    code = launch([*argv, "--no-summary"], args.nproc)
    if code == 0:  # the ranks were this process's children's children: the largest one's peak
        emit(args, summaries.train_summary(job, argv, memory(plan, resource.RUSAGE_CHILDREN)), summaries.render_train)
    return code


def train_here(args: argparse.Namespace, job, world) -> int:
    """The run in this process (one rank of many under torchrun): the job's outcome as an exit code."""
    from exactresume.progress import Progress
    from exactresume.training.job_run import JobRun
    from exactresume.training.preemption import PREEMPTED_EXIT

    progress = Progress(job.until, args.label, mode_from_args(args) if world.is_main else "none")
    outcome = JobRun(job, world, progress).run()
    if outcome.preempted is not None:
        print(f"exactresume train: {outcome.preempted}", file=sys.stderr)
        return PREEMPTED_EXIT
    return 0


def resume_source(text: str) -> Path | str:
    """--resume's value: 'auto', an `s3://` location (made with --s3-endpoint later), or a file or folder."""
    return text if text == "auto" or text.startswith("s3://") else Path(text)


def any_location(text: str) -> Path | str:
    """A path, or an `s3://` location (kept as text until --s3-endpoint is known)."""
    return text if text.startswith("s3://") else Path(text)


def cmd_lab(args: argparse.Namespace) -> int:
    from exactresume.lab.warm_start import start_server

    train = config_from_args(args)
    if 1 <= args.stop_at < train.steps:  # else LabConfig refuses it below: start nothing for a refusal
        start_server()  # before importing torch here, so the fork server's imports overlap with ours
    from exactresume.lab.lab import LabConfig, run_lab
    from exactresume.parallel.split import check_split
    from exactresume.world import launched_by_torchrun

    if launched_by_torchrun():
        raise UserError("run the lab as one process: with --nproc N it starts each training run on N processes")
    check_split(args.batch, args.nproc, args.grad_accum, args.micro_batch)
    config = LabConfig(
        train=train,
        stop_at=args.stop_at,
        data=args.data,
        out=args.out,
        lang=args.lang,
        ablate=args.ablate,
        nproc=args.nproc,
    )
    lock = lock_out(args)  # released below; on an error, when the process ends
    lock.share_with_children()  # the lab's training processes write --out under this lock
    run_lab(config, progress_mode=mode_from_args(args))
    lock.release()
    emit(args, summaries.lab_summary(args.out), summaries.render_lab)
    return 0


def cmd_ablate(args: argparse.Namespace) -> int:
    from exactresume.lab.ablate import ABLATION_VERSION, AblationConfig, run_ablation
    from exactresume.report.tables import render_markdown, write_readme_block

    if args.markdown is None:
        if args.out is None or args.readme is not None:
            raise UserError(
                "give --out DIR to run the ablation, or --markdown ablation.json [--readme FILE] to render one"
            )
        config = AblationConfig(
            train=config_from_args(args),
            stop_at=args.stop_at,
            data=args.data,
            out=args.out,
            dropout=args.ablation_dropout,
        )
        lock = lock_out(args)
        run_ablation(config)
        lock.release()
        emit(args, summaries.ablate_summary(args.out), summaries.render_ablate)
        return 0
    try:
        ablation = json.loads(args.markdown.read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"cannot read the ablation {args.markdown}: {error}") from None
    if not isinstance(ablation, dict) or ablation.get("version") != ABLATION_VERSION:
        raise UserError(f"{args.markdown} is not an ablation.json of version {ABLATION_VERSION}")
    if args.readme is None:
        print(render_markdown(ablation))
    else:
        write_readme_block(args.readme, ablation)
        emit(args, {"command": "ablate", "readme": str(args.readme)}, lambda s: [f"wrote the table into {s['readme']}"])
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from exactresume.core.compare import tensor_differences
    from exactresume.store.weights import read_weights

    differences = tensor_differences(read_weights(place(args.a, args))[0], read_weights(place(args.b, args))[0])
    unequal = {name: diff for name, diff in differences.items() if not diff.within(args.atol)}
    summary = {
        "command": "diff",
        "a": str(args.a),
        "b": str(args.b),
        "tensors": len(differences),
        "max_abs_diff": max((diff.max_abs for diff in differences.values()), default=0.0),  # over finite values
        "atol": args.atol,
        "equal": not unequal,
        "unequal": {name: {"max_abs_diff": diff.max_abs, "what": diff.describe()} for name, diff in unequal.items()},
        # NaN and Inf counted in (A, B): a non-finite value is equal only where its bits are.
        "nan": [sum(diff.nan[i] for diff in differences.values()) for i in (0, 1)],
        "inf": [sum(diff.inf[i] for diff in differences.values()) for i in (0, 1)],
    }
    emit(args, summary, render_diff, gap=False)
    return 0 if summary["equal"] else 1


def render_diff(summary: dict) -> list[str]:
    lines = [f"{value['max_abs_diff']:.3e}  {name}  ({value['what']})" for name, value in summary["unequal"].items()]
    notes = [f"{label} {a} in A, {b} in B" for label in ("NaN", "Inf") for a, b in [summary[label.lower()]] if a or b]
    scope = f" over finite values ({', '.join(notes)})" if notes else ""
    if summary["unequal"]:
        count = len(summary["unequal"])
        scope += f", {count} {'tensor' if count == 1 else 'tensors'} not equal"
    verdict = "equal" if summary["equal"] else "different"
    tensors, worst, atol = summary["tensors"], summary["max_abs_diff"], summary["atol"]
    return lines + [f"{tensors} tensors, max abs difference {worst:.3e}{scope}: {verdict} (atol {atol:g})"]


def cmd_inspect(args: argparse.Namespace) -> int:
    from exactresume.store.contents import format_inspection, inspect_checkpoint

    info = inspect_checkpoint(place(args.path, args))
    emit(args, info, lambda info: [format_inspection(info)], gap=False)
    # A folder or prefix listed with a damaged checkpoint in it: a script checking a store must not read "all well".
    return 1 if info["kind"] == "store" and info["checksum"] != "verified" else 0


def cmd_export(args: argparse.Namespace) -> int:
    from exactresume.training.inference import ExportConfig, describe_export, export_weights, format_for

    config = ExportConfig(
        args.source,
        args.out,
        dtype=args.dtype,
        format=args.format or format_for(args.out),
        clamp=args.clamp,
        data=args.data,
    )
    result = export_weights(config)
    summary = {"command": "export", "source": str(config.source), "out": str(config.out), "dtype": config.dtype}
    summary |= {"format": config.format} | result
    emit(args, summary, lambda s: describe_export(config, result), gap=False)
    return 0
