"""`exactresume lab`: the whole lab (straight, stopped, resumed, ablations, fp16) and its report.

exactresume lab --out runs/lab --ablate
"""

from __future__ import annotations

import argparse
import signal

from exactresume import summaries
from exactresume.commands.config_flags import (
    ABLATION_GROUP,
    OUTPUTS_GROUP,
    PROCESSES_GROUP,
    RUN_GROUP,
    add_config_flags,
    add_groups,
    config_from_args,
)
from exactresume.commands.output import add_output_flags, emit, progress_mode
from exactresume.commands.places import DEFAULT_DATA, add_data_flag, given_path
from exactresume.commands.train import add_process_flag
from exactresume.commands.writer import add_writer_flags, first_missing, lock_out, remove_made_folder
from exactresume.errors import UserError


def add_flags(parser: argparse.ArgumentParser) -> None:
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
    outputs.add_argument("--out", type=given_path, required=True, help="output folder")
    outputs.add_argument("--lang", choices=("ko", "en", "zh"), default="ko", help="language of the report's body")
    add_output_flags(outputs)
    add_writer_flags(outputs)
    add_process_flag(groups[PROCESSES_GROUP])


def run(args: argparse.Namespace) -> int:
    from exactresume.lab.runs import start_runs_server

    train = config_from_args(args)
    if args.data != DEFAULT_DATA:  # the default is prepared where it is missing; a folder typed, never
        from exactresume.core.data import check_prepared

        check_prepared(args.data)
    if 1 <= args.stop_at < train.steps:  # else LabConfig refuses it below: start nothing for a refusal
        start_runs_server()  # before importing torch here, so the fork server's imports overlap with ours
    from exactresume.lab.lab import LabConfig, run_lab
    from exactresume.world import launched_by_torchrun

    if launched_by_torchrun():
        raise UserError("run the lab as one process: with --nproc N it starts each training run on N processes")
    config = LabConfig(
        train=train,
        stop_at=args.stop_at,
        data=args.data,
        out=args.out,
        lang=args.lang,
        ablate=args.ablate,
        nproc=args.nproc,
    )
    made = first_missing(config.out)
    lock = lock_out("lab", config.out, args.wait_lock)  # released below; on an error, when the process ends
    lock.share_with_children()  # the lab's training processes write --out under this lock
    signal.signal(signal.SIGTERM, _as_an_interrupt)  # a scheduler's stop: the runs ended, the files left as by Ctrl-C
    try:
        run_lab(config, progress_mode=progress_mode(args))
    except UserError:
        if made is not None:  # refused before its runs wrote anything: the folders it made go
            lock.release()
            remove_made_folder(made)
        raise
    lock.release()
    emit(args, summaries.lab_summary(config.out), summaries.render_lab)
    return 0


def _as_an_interrupt(signal_number, frame) -> None:
    raise KeyboardInterrupt
