"""`exactresume train`: its flags, the TrainJob they make, the run (here or on N processes), its summary.

    exactresume train --out runs/a --stop-at 30
    exactresume train --out runs/a --resume runs/a/resume.pth

`_job_from(args)` is the only reader of train's flags: every value is checked once, where the job
defines it (training/job.py), and everything below takes the job.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from pathlib import Path

from exactresume import summaries
from exactresume.commands.config_flags import (
    ABLATION_GROUP,
    CHECKPOINTS_GROUP,
    OUTPUTS_GROUP,
    PROCESSES_GROUP,
    RUN_GROUP,
    add_config_flags,
    add_groups,
    config_from_args,
)
from exactresume.commands.output import add_output_flags, emit, progress_mode
from exactresume.commands.places import (
    add_data_flag,
    add_s3_flags,
    any_location,
    check_endpoint_used,
    given_path,
    local_folder,
    place,
    resume_source,
)
from exactresume.commands.writer import add_writer_flags, first_missing, remove_made_folder
from exactresume.errors import UserError, listed
from exactresume.training.outputs import refuse_other_kinds


def add_flags(parser: argparse.ArgumentParser) -> None:
    groups = add_groups(parser)
    add_data_flag(groups[RUN_GROUP])
    add_config_flags(groups)
    _add_checkpoint_flags(groups[CHECKPOINTS_GROUP])
    ablation = groups[ABLATION_GROUP]
    ablation.add_argument("--no-optim", action="store_true", help="resume without the optimizer state")
    ablation.add_argument("--no-skip", action="store_true", help="resume with the batch generator reseeded")
    _add_outputs(groups[OUTPUTS_GROUP])
    processes = groups[PROCESSES_GROUP]
    add_process_flag(processes)
    processes.add_argument(
        "--sharded",
        action="store_true",
        help="write the resume state as OUT/resume.dcp, a torch.distributed.checkpoint folder",
    )


STOP_AT_HELP = "stop after this step and write OUT/resume.pth (the folder resume.dcp with --shard fsdp)"
SAVE_EVERY_HELP = (
    "write OUT/checkpoints/step-N.pth too (step-N.dcp folders with --shard fsdp) every N steps and at the end"
)


def _add_checkpoint_flags(checkpoints) -> None:
    checkpoints.add_argument("--stop-at", type=int, help=STOP_AT_HELP)
    add_writer_flags(checkpoints, plan=True)
    checkpoints.add_argument(
        "--resume",
        type=resume_source,
        metavar="FILE|FOLDER|auto",
        help="continue from a resume file, the newest valid checkpoint in a folder, or with 'auto' from "
        "the newest valid checkpoint in --checkpoints (default OUT/checkpoints), else a fresh start",
    )
    checkpoints.add_argument("--save-every", type=int, metavar="N", help=SAVE_EVERY_HELP)
    checkpoints.add_argument(
        "--checkpoints",
        type=any_location,
        metavar="FOLDER|s3://BUCKET/PREFIX",
        help="where the periodic checkpoints go (default OUT/checkpoints); on s3:// the resume file goes there too",
    )
    add_s3_flags(checkpoints, uploads=True)
    checkpoints.add_argument(
        "--local-checkpoints",
        type=local_folder,
        metavar="DIR",
        help="save each --save-every checkpoint to this fast local folder (a local disk, /dev/shm) and copy "
        "every --durable-every N-th step to --checkpoints in the background",
    )
    checkpoints.add_argument(
        "--durable-every", type=int, metavar="N", help="with --local-checkpoints: which steps go to --checkpoints"
    )
    checkpoints.add_argument(
        "--keep", type=int, default=3, metavar="K", help="keep the newest K checkpoints (0: all; default 3)"
    )
    checkpoints.add_argument(
        "--async-save",
        nargs="?",
        const="thread",
        choices=("thread", "process"),
        help="write the periodic checkpoints in the background (training waits only for a copy of the state);"
        " with 'process' a helper process pickles them, not a thread of the training process",
    )
    checkpoints.add_argument(
        "--allow-change",
        action="append",
        default=[],
        metavar="FIELD",
        help="let a resume change steps, lr, batch, seq-len or data on purpose (repeatable)",
    )


def _add_outputs(outputs) -> None:
    outputs.add_argument("--out", type=given_path, required=True, help="output folder")
    outputs.add_argument("--weights", type=given_path, help="weights file at the end (default OUT/final.pth)")
    outputs.add_argument("--log", type=given_path, help="loss log, step,train_loss (default OUT/log.csv)")
    outputs.add_argument("--samples", type=given_path, help="also log each step's window offsets, step,starts")
    outputs.add_argument(
        "--overwrite", action="store_true", help="a fresh run replaces an earlier run's weights, log and resume file"
    )
    outputs.add_argument(
        "--divergence",
        type=given_path,
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


def _job_from(args: argparse.Namespace, world):
    """The job train's flags describe, checked as it is made (before torch is imported, before anything
    is written). A torchrun rank's job trains on its world's processes."""
    from exactresume.training.job import TrainJob
    from exactresume.world import launched_by_torchrun

    skip = frozenset(name for flag, name in ((args.no_optim, "optimizer"), (args.no_skip, "gen_state")) if flag)
    check_endpoint_used(args, args.resume, args.checkpoints)
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
        keep=args.keep,
        allow_change=frozenset(args.allow_change),
        async_save=args.async_save,
        sharded=args.sharded,
        divergence=args.divergence,
        wait_lock=args.wait_lock,
        checkpoints=place(args.checkpoints, args) if args.checkpoints else None,
        local_checkpoints=args.local_checkpoints,
        durable_every=args.durable_every,
        processes=world.size if launched_by_torchrun() else args.nproc,
        force=args.force,
        overwrite=args.overwrite,
        dry_run=args.dry_run,
    )


def run(args: argparse.Namespace) -> int:
    from exactresume.world import World

    world = World.from_env()
    # The ranks of a torchrun launch share the folder its rank 0 (or the launching process) cleans up.
    made, code = first_missing(args.out) if world.is_main else None, 1
    try:
        job = _job_from(args, world)
        if world.is_main:  # the other ranks of a torchrun launch write none of them
            refuse_other_kinds(job.outputs())
            _refuse_earlier_outputs(job)
        code = train(args, job, world)
    finally:
        if made is not None and code != 0:
            remove_made_folder(made)
    return code


def _checkpoints_in(folder: Path) -> bool:
    """Whether `folder` holds a checkpoint's name (one written, being written or set aside)."""
    names = os.listdir(folder) if folder.is_dir() else []
    if not names:
        return False
    from exactresume.store.layout import is_store_name  # with torch: only where the folder holds something

    return any(map(is_store_name, names))


def _refuse_earlier_outputs(job) -> None:
    """A fresh run never overwrites what an earlier run left in its place: one line, nothing written."""
    found = [str(path) for path in job.earlier_outputs()]
    # its checkpoints too, which no flag replaces: --overwrite would only meet the store's refusal next
    folders = job.checkpoint_folders().values() if found and job.save_every else ()
    held = [str(folder) for folder in folders if _checkpoints_in(folder)]
    if held:
        raise UserError(
            f"this fresh run would overwrite an earlier run's {listed(found)} and save beside its checkpoints in "
            f"{listed(held)}, which --overwrite does not replace: continue that run with --resume auto, or give "
            "this one another --out"
        )
    if found:
        them = "it" if len(found) == 1 else "them"
        raise UserError(
            f"this fresh run would overwrite an earlier run's {listed(found)}: give another --out, or --overwrite to "
            f"replace {them} (--resume continues a run from its resume file or checkpoints)"
        )


def train(args: argparse.Namespace, job, world) -> int:
    """The job here, or launched on its processes; then the summary (`args` only for what is printed)."""
    from exactresume.training.plan import plan_job
    from exactresume.world import launched_by_torchrun

    argv = getattr(args, "argv", sys.argv[1:])  # main sets it; a caller of its own may not
    # The plan before torch is imported: a run that cannot fit is refused at once. torchrun's ranks
    # skip it, and the launch: their launching process checked the whole machine and started them.
    plan = None if launched_by_torchrun() else plan_job(job)
    if job.dry_run and plan is not None:
        return 0
    if plan is not None and job.processes > 1:  # the ranks are this process's children's children
        code, who = _launch_ranks(args.main, argv, job.processes), resource.RUSAGE_CHILDREN
    else:
        mode = progress_mode(args) if world.is_main else "none"
        code, who = _train_here(job, world, args.label, mode), resource.RUSAGE_SELF
    if code == 0 and world.is_main:
        summary = summaries.train_summary(job, argv, memory(plan, who))
        emit(args, summary, summaries.render_train)
    return code


def memory(plan, who: int) -> dict | None:
    """The peak resident memory of the largest process of the run (this one, or its ranks), and the plan's."""
    if plan is None:
        return None
    return {"peak_bytes": resource.getrusage(who).ru_maxrss * 1024, "planned_bytes": plan.process_bytes}


def _launch_ranks(main, argv: list[str], processes: int) -> int:
    """`train --nproc N`: the same command, `main(ARGV)`, in N processes (parallel.launch), each a fork
    of this one with the training modules imported; this one sums up after."""
    import exactresume.training.job_run  # noqa: F401  (imported once here, not in every rank)
    from exactresume.parallel.launch import launch

    return launch(main, [*argv, "--no-summary"], processes)


def _train_here(job, world, label: str, mode: str) -> int:
    """The run in this process (one rank of many under torchrun): the job's outcome as an exit code."""
    from exactresume.progress import Progress
    from exactresume.training.job_run import JobRun
    from exactresume.training.preemption import PREEMPTED_EXIT

    outcome = JobRun(job, world, Progress(job.until, label, mode)).run()
    if outcome.preempted is not None:
        print(f"exactresume train: {outcome.preempted}", file=sys.stderr)
        return PREEMPTED_EXIT
    return 0
