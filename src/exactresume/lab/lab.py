"""The lab from the user's specification, as one command: eight steps, each writing its files.

1 straight run, 2 stop at K with a resume file, 3 resume in a new process, 4 resume without the
optimizer (noopt), 5 resume with the batch generator reseeded (noskip) — each training run in its
own process — then 6 half precision, 7 optimizer vs weight elements, 8 the report and its figures.
Runs 1 and 2 start from nothing and 3-5 from 2's resume file: each group's runs go side by side, as
many at once as there are cores for them (a run's thread count is part of its result, so running
together changes no bit). Their progress is shown in order, each run's as it goes once the runs
before it have ended; an interrupt or a failure stops the runs still going before the lab returns.
Numbers in the report come only from the files these steps write. noopt and noskip also step a
fully restored twin alongside (`--divergence`), logging their drift from the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from exactresume.atomic import ensure_writable_folder, write_json
from exactresume.config import TrainConfig
from exactresume.core.compare import identical, largest, loss_differences, repeated_batches, weight_distance
from exactresume.core.data import ensure_data
from exactresume.core.steplog import read_loss_log, read_samples
from exactresume.errors import UserError
from exactresume.forkserver.client import Run
from exactresume.lab.record import RUN_RECORD, run_record
from exactresume.lab.runs import spawn_cli, start_runs_server
from exactresume.progress import ByteProgress
from exactresume.store.contents import resume_size_breakdown
from exactresume.store.lock import held_lock_env
from exactresume.store.resume import read_resume_file
from exactresume.store.weights import read_weights, save_weights
from exactresume.training.device import training_device
from exactresume.training.inference import convert, max_logit_difference
from exactresume.training.job import TrainJob
from exactresume.training.plan import plan_job

DETAILS = "details"  # logs the report needs beyond the files the lab text names
RUN_ERROR_PREFIX = re.compile(r"^exactresume [\w-]+: error: ")  # a run's own line begins so; the lab's says it once
DIVERGENCE_RUNS = ("noopt", "noskip")  # also step a fully restored twin and log the distance per step
RUN_GROUPS = (("straight", "stop"), ("resumed", "noopt", "noskip"))  # a group's runs need nothing of each other
FOLLOW_S = 0.5  # how often the run being shown is looked at for new progress
# What the lab writes at the top of its folder (besides its figures): an earlier lab's, cleared before a lab
# runs there again, so that no row of a log a resumed run continues, and no ablation of before, outlives it.
LAB_OUTPUTS = (
    *(f"{run}.pth" for run in ("straight", "resume", "resumed", "noopt", "noskip", "straight_fp16")),
    *("straight_log.csv", "resumed_log.csv", "fp16.json", "optim.json", "compare.json", "report.md"),
    *("ablation", "ablation.json", "ablation.md", DETAILS),
    "checkpoints",  # what its runs saved when a Ctrl-C reached them (no lab run saves otherwise)
)


@dataclass(frozen=True)
class LabConfig:
    train: TrainConfig = field(default_factory=TrainConfig)
    stop_at: int = 30
    data: Path = Path("data/kjv")
    out: Path = Path("runs/lab")
    lang: str = "ko"
    ablate: bool = False  # also run the ablation (ablate.py) into the same folder, for the report
    nproc: int = 1  # processes of each training run (torchrun, DDP)

    def __post_init__(self) -> None:
        self.stopped_job()  # what `exactresume train` checks of the lab's runs, checked once, by it
        if self.train.shard != "none":  # its runs resume from one resume.pth; FSDP2 writes a DCP folder
            raise UserError("the lab runs without --shard fsdp (exactresume train takes it)")

    def stopped_job(self) -> TrainJob:
        """Step 2, the run stopped with a resume file, as `exactresume train` takes it (its stop, its
        processes' split of the batch, its folders apart)."""
        return TrainJob(self.train, self.data, self.out, stop_at=self.stop_at, processes=self.nproc)


def _train_flags(config: LabConfig) -> list[str]:
    """The flags that give every training run the lab's data, config (its run record, written first)
    and process count."""
    return [
        "--data",
        str(config.data),
        "--config",
        str(config.out / DETAILS / RUN_RECORD),
        "--nproc",
        str(config.nproc),
    ]


def _training_runs(config: LabConfig) -> list[tuple[str, list[str]]]:
    """Steps 1-5 as `exactresume train` argument lists, in the order they must run."""
    out, details, resume = config.out, config.out / DETAILS, str(config.out / "resume.pth")

    def files(name: str, log: Path) -> list[str]:
        return [
            "--weights",
            str(out / f"{name}.pth"),
            "--log",
            str(log),
            "--samples",
            str(details / f"{name}_samples.csv"),
        ]

    # The lab's folder is its own: a lab run again remakes every file, as it made them the first time.
    return [
        ("straight", ["--overwrite", *files("straight", out / "straight_log.csv")]),
        (
            "stop",
            [
                "--overwrite",
                "--stop-at",
                str(config.stop_at),
                "--log",
                str(details / "stopped_log.csv"),
                "--samples",
                str(details / "stopped_samples.csv"),
            ],
        ),
        ("resumed", ["--resume", resume] + files("resumed", out / "resumed_log.csv")),
        ("noopt", ["--resume", resume, "--no-optim"] + files("noopt", details / "noopt_log.csv")),
        ("noskip", ["--resume", resume, "--no-skip"] + files("noskip", details / "noskip_log.csv")),
    ]


def _divergence_flags(name: str, config: LabConfig) -> list[str]:
    """`--divergence details/NAME_divergence.csv` for the runs the divergence figure draws."""
    return ["--divergence", str(config.out / DETAILS / f"{name}_divergence.csv")] if name in DIVERGENCE_RUNS else []


def _side_by_side(config: LabConfig) -> int:
    """How many of the lab's runs go at once: as many as the cores this process may use hold (a run
    takes `threads` of them on each of its `nproc` processes)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // (config.train.threads * config.nproc))


def _start_training_process(config: LabConfig, flags: list[str], progress_mode: str, label: str) -> Run:
    """One `exactresume train` in a new process (forked from a warm server), not waited for."""
    argv = ["train", "--out", str(config.out), *_train_flags(config), *flags, "--progress", progress_mode]
    argv += ["--label", label, "--no-summary"]  # the lab ends with its own summary
    # The lab holds the lock on --out for its training processes (commands/lab.py).
    return spawn_cli(argv, env=held_lock_env())


def _follow(run: Run, progress_mode: str, tick) -> None:
    """Wait for `run`, passing on its progress as it comes; `tick()` after every look."""
    shown, ended = 0, False
    while not ended:
        try:
            run.wait(FOLLOW_S)
            ended = True
        except subprocess.TimeoutExpired:
            pass
        tick()
        if progress_mode != "none":
            lines = run.output()[0]
            print(lines[shown:], end="", flush=True)
            shown = len(lines)


def _check_ended(name: str, run: Run) -> None:
    """UserError (its one line) or RuntimeError unless the run of lab step `name` succeeded."""
    if run.returncode == 0:
        return
    stderr = run.output()[1]
    lines = stderr.strip().splitlines() or [f"exit code {run.returncode}"]
    if run.returncode == 2:
        raise UserError(f"lab step {name}: {RUN_ERROR_PREFIX.sub('', lines[-1])}")
    raise RuntimeError(f"lab step {name} failed:\n{stderr}")


def _end(runs: list[Run]) -> None:
    """The runs still going, stopped as a Ctrl-C stops a run and waited for, so that none writes after the
    lab returns (it was interrupted, or a run before them failed); a second Ctrl-C kills them at once."""
    runs = [run for run in runs if run.poll() is None]
    try:
        for run in runs:
            run.send_signal(signal.SIGINT)
        for run in runs:
            run.wait()
    except KeyboardInterrupt:
        for run in runs:
            run.kill()
        for run in runs:
            run.wait()
        raise


def _run_training(config: LabConfig, progress_mode: str, log) -> dict[str, float]:
    """Steps 1-5, each group's runs side by side: each run shown in order as it goes, the ones after it
    starting as cores are free; each run's wall time in seconds."""
    runs = _training_runs(config)
    labels = {name: f"[{number}/8] {name}" for number, (name, _) in enumerate(runs, start=1)}
    flags = {name: run_flags + _divergence_flags(name, config) for name, run_flags in runs}
    lanes, timings, going = _side_by_side(config), {}, {}  # going: name -> (run, when it started)

    def tick() -> None:  # each run's time, to when it was first seen ended (the one shown: at once)
        for other, (run, started) in going.items():
            if other not in timings and run.poll() is not None:
                timings[other] = time.perf_counter() - started

    try:
        for group in RUN_GROUPS:
            waiting = list(group)
            for name in group:
                while waiting and len(going) < lanes:
                    new = waiting.pop(0)
                    going[new] = (
                        _start_training_process(config, flags[new], progress_mode, labels[new]),
                        time.perf_counter(),
                    )
                run = going[name][0]
                _follow(run, progress_mode, tick)
                del going[name]
                _check_ended(name, run)
                log(f"{labels[name]}: {timings[name]:.1f} s")
    finally:
        _end([run for run, _ in going.values()])
    return {name: timings[name] for name, _ in runs}  # in the steps' order


def _check_the_runs_can_start(config: LabConfig) -> None:
    """What its training runs would refuse at their start: a run that cannot fit this machine's memory or
    disk (their plan, which their steps do not change), a device it does not have."""
    try:
        plan_job(config.stopped_job())
    except UserError as error:  # train's own advice less --force, which the lab does not take
        raise UserError(str(error).removesuffix(" (--force to start anyway)")) from None
    training_device(config.train)


def _clear_an_earlier_lab(out: Path) -> None:
    """A lab run again into its folder remakes it whole; files of the lab's names that no lab made (no run
    record beside them: a training run's resume.pth, say) are refused, not written over."""
    from exactresume.report.figures import FIGURES, figure_path

    named = [*(out / name for name in LAB_OUTPUTS), *(figure_path(out, figure) for figure in FIGURES)]
    present = [path for path in named if os.path.lexists(path)]
    if present and not _is_lab_record(out / DETAILS / RUN_RECORD):
        names = ", ".join(path.name for path in present)
        raise UserError(f"{out} holds {names}, not an earlier lab's (no {DETAILS}/{RUN_RECORD}): give another --out")
    for path in present:
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def _is_lab_record(path: Path) -> bool:
    """Whether `path` is the run record a lab writes (run_record): its config, with the lab's stop_at."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and isinstance(record.get("config"), dict) and "stop_at" in record["config"]


def _fp16_figures(config: LabConfig) -> dict:
    """Step 6: write straight_fp16.pth (export's fp16 conversion, a tied tensor stored once); the sizes
    and the max logit difference on val.npy's first 128 tokens."""
    straight, half = config.out / "straight.pth", config.out / "straight_fp16.pth"
    state, model_config = read_weights(straight)
    save_weights(half, convert(state, torch.float16, clamp=False))
    difference, _ = max_logit_difference(state, model_config, half, config.data)
    return {
        "fp32_bytes": straight.stat().st_size,
        "fp16_bytes": half.stat().st_size,
        "size_ratio": half.stat().st_size / straight.stat().st_size,
        "max_logit_diff": difference,
    }


def _optimizer_figures(resume_file: Path) -> dict:
    """Step 7: weight elements (lm_head.weight is the tied embedding) vs optimizer-state elements."""
    state = read_resume_file(resume_file)
    model_numel = sum(t.numel() for name, t in state["model"].items() if name != "lm_head.weight")
    optimizer_numel = sum(
        t.numel()
        for per_param in state["optimizer"]["state"].values()
        for t in per_param.values()
        if isinstance(t, torch.Tensor) and t.dim() >= 1
    )
    return {"model_numel": model_numel, "optimizer_numel": optimizer_numel, "ratio": optimizer_numel / model_numel}


def comparison_figures(config: LabConfig) -> dict:
    """resumed / noopt / noskip against straight: weights, losses and batches."""
    out, details, k = config.out, config.out / DETAILS, config.stop_at
    straight_weights = read_weights(out / "straight.pth")[0]
    straight_log = read_loss_log(out / "straight_log.csv")
    straight_samples = read_samples(details / "straight_samples.csv")
    logs = {
        "resumed": out / "resumed_log.csv",
        "noopt": details / "noopt_log.csv",
        "noskip": details / "noskip_log.csv",
    }
    runs = {}
    for name, log_path in logs.items():
        log, samples = read_loss_log(log_path), read_samples(details / f"{name}_samples.csv")
        diffs = loss_differences(log, straight_log)
        later = {tuple(starts) for step, starts in straight_samples.items() if step > k}
        weights = read_weights(out / f"{name}.pth")[0]
        runs[name] = weight_distance(weights, straight_weights) | {
            "tensors": len(weights),
            "bits_equal": identical(weights, straight_weights),
            "log_rows_equal": all(straight_log[step] == loss for step, loss in log.items()),
            "first_resumed_loss_diff": diffs[0]["diff"],
            "final_loss_diff": diffs[-1]["diff"],
            "max_abs_loss_diff": largest(abs(d["diff"]) for d in diffs),
            "batches_seen_twice": repeated_batches(samples, straight_samples, before=k),
            "batches_never_seen": len(later - {tuple(s) for s in samples.values()}),
            "loss_diffs": diffs,
        }
    return {"stop_at": k, "steps": config.train.steps, "runs": runs}


def run_lab(config: LabConfig, log=print, progress_mode: str = "lines") -> dict:
    """All eight steps; returns the timings (seconds) it also writes to details/timings.json.

    `progress_mode` (bar, lines or none) is passed to each training process; none also silences `log`.
    """
    log = log if progress_mode != "none" else (lambda message: None)
    _check_the_runs_can_start(config)  # before an earlier lab's files are cleared: a refusal loses none
    _clear_an_earlier_lab(config.out)
    ensure_writable_folder(config.out / DETAILS)
    write_json(config.out / DETAILS / RUN_RECORD, run_record(config))
    start_runs_server()
    torch.set_num_threads(config.train.threads)  # for the lab's own figures (fp16 logits) as for its runs
    started = time.perf_counter()
    ensure_data(config.data, log, ByteProgress("prepare: encode", progress_mode))
    timings = {"prepare": time.perf_counter() - started} | _run_training(config, progress_mode, log)
    write_json(config.out / "fp16.json", _fp16_figures(config))
    log("[6/8] fp16.json")
    write_json(config.out / "optim.json", _optimizer_figures(config.out / "resume.pth"))
    log("[7/8] optim.json")
    write_json(config.out / "compare.json", comparison_figures(config))
    write_json(config.out / DETAILS / "resume_sizes.json", resume_size_breakdown(config.out / "resume.pth"))
    if config.ablate:
        from exactresume.lab.ablate import AblationConfig, run_ablation

        run_ablation(AblationConfig(train=config.train, stop_at=config.stop_at, data=config.data, out=config.out), log)
    from exactresume.report.figures import write_figures  # matplotlib loads only here
    from exactresume.report.report import write_report  # the report and its figures read only the files written above

    figures_started = time.perf_counter()
    write_figures(config.out)
    timings["figures"] = time.perf_counter() - figures_started
    write_report(config.out, lang=config.lang)
    timings["total"] = time.perf_counter() - started
    write_json(config.out / DETAILS / "timings.json", timings)
    log(f"[8/8] report.md ({timings['total']:.1f} s in all)")
    return timings
