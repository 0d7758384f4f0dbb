"""The doctor's three runs of the user's command, and the files between them.

    straight     the command, cut as optimizer step STEPS+1 begins
    interrupted  the command, ended as a crash would end it as the first step after a checkpoint
                 saved at or after step STOP_AFTER begins (every file of that step is complete)
    resumed      the command with the resume arguments, cut after STEPS steps in all

What the straight run saved is moved into OUT/files/straight before the interrupted run, so the
resume can only find the interrupted run's checkpoint; at the end the interrupted and resumed runs'
files go to OUT/files/resumed and the straight run's come back where the script wrote them. A file
that was there before the doctor and that the straight run replaced was copied to OUT/files/before
first, and it is what comes back (the straight run's stays in OUT/files/straight).
OUT/files/moved.json lists every move before it is made.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from exactresume.doctor.run import Run, run_traced
from exactresume.doctor.tracer.fingerprint import summary, top_keys
from exactresume.errors import UserError


@dataclass
class Plan:
    command: list[str]
    resume_args: list[str]
    steps: int
    stop_after: int
    out: Path
    timeout: float | None = None


@dataclass
class Runs:
    straight: Run
    interrupted: Run
    resumed: Run
    resume_step: int
    files: list[dict]  # what the interrupted run left at the resume: path, step, keys, tensors
    moves: list[dict]


def examine(plan: Plan) -> Runs:
    ledger = plan.out / "files" / "moved.json"
    if ledger.exists():
        raise UserError(f"{ledger} lists files a previous doctor run put aside: put them back, or use another --out")
    keep = plan.out / "files" / "before"
    straight = run_traced("straight", plan.command, plan.out, plan.steps, timeout=plan.timeout, keep=keep)
    moves = move_aside(straight.written(), plan.out / "files" / "straight", ledger, straight.kept)
    written: list[str] = []
    try:
        check_straight(straight, plan)
        interrupted = run_traced("interrupted", plan.command, plan.out, plan.steps, plan.stop_after, plan.timeout)
        written += interrupted.written()
        resume_step = check_interrupted(interrupted, plan)
        files = read_files(interrupted, resume_step)
        command = plan.command + plan.resume_args
        resumed = run_traced("resumed", command, plan.out, plan.steps - resume_step, timeout=plan.timeout)
        written += resumed.written()
        check_resumed(resumed, interrupted, plan)
    finally:
        moves += put_back(moves, written, plan.out / "files" / "resumed", ledger, straight.kept)
    return Runs(straight, interrupted, resumed, resume_step, files, moves)


def failed(run: Run) -> bool:
    return not (run.cut or run.crashed or run.rc == 0)


def check_straight(run: Run, plan: Plan) -> None:
    if failed(run):
        raise UserError(run.failure())
    early = [load["path"] for load in run.loads if load["step"] == 0 and load["path"]]
    if early:
        raise UserError(f"the straight run was not fresh: it loaded {early[0]} before its first step; move it away")
    if not run.steps:
        raise UserError("the straight run took no optimizer step (the doctor counts torch.optim optimizers' step())")
    if len(run.steps) < plan.steps:
        raise UserError(
            f"the straight run ended after {len(run.steps)} optimizer steps, fewer than --steps {plan.steps}"
        )


def check_interrupted(run: Run, plan: Plan) -> int:
    if run.crashed:
        return run.saves[-1]["step"]
    if failed(run):
        raise UserError(run.failure())
    saved = sorted({s["step"] for s in run.saves})
    said = f"it saved at steps {', '.join(map(str, saved))}" if saved else "it saved nothing the doctor could see"
    raise UserError(
        f"the script saved no checkpoint at or after --stop-after {plan.stop_after} within {plan.steps} steps ({said})"
    )


def check_resumed(run: Run, interrupted: Run, plan: Plan) -> None:
    if failed(run):
        raise UserError(run.failure())
    written = {s["path"] for s in interrupted.saves}
    if not any(load["path"] in written for load in run.loads):
        hint = f"the resume arguments {' '.join(plan.resume_args)!r}" if plan.resume_args else "no --resume-args"
        raise UserError(f"the resumed run started at step 0: it loaded none of the checkpoint files; {hint} ignored?")
    if not run.steps:
        raise UserError("the resumed run took no optimizer step after loading its checkpoint")


def read_files(run: Run, step: int) -> list[dict]:
    """What each file saved at the resume step holds, read back with weights_only=True."""
    rows = []
    for save in run.saves:
        if save["step"] != step or not save["path"]:
            continue
        row = {k: save[k] for k in ("path", "step", "pending_micro", "live", "loaders")}
        try:
            state = torch.load(save["path"], map_location="cpu", weights_only=True)
            row |= {"keys": top_keys(state), "tensors": summary(state), "read": "weights_only=True"}
        except Exception as error:  # a file weights_only refuses: keep what torch.save was given
            row |= {"keys": save["keys"], "tensors": save["tensors"], "read": f"as saved ({type(error).__name__})"}
        rows.append(row)
    return rows


def move_aside(paths: list[str], folder: Path, ledger: Path, kept: dict[str, str]) -> list[dict]:
    """Move the straight run's files into `folder`; `kept` (path -> copy) are files the script
    replaced that were there before the doctor: they go back at the end, not the straight run's."""
    folder.mkdir(parents=True, exist_ok=True)
    moves = [{"from": p, "aside": str(folder / f"{i:03d}-{Path(p).name}")} for i, p in enumerate(paths)]
    ledger.write_text(json.dumps({"moves": moves, "kept": kept}, indent=1))
    for move in moves:
        shutil.move(move["from"], move["aside"])
    return moves


def put_back(moves: list[dict], written: list[str], folder: Path, ledger: Path, kept: dict[str, str]) -> list[dict]:
    """The doctor's own runs' files into `folder`, then the files that were there before the doctor
    back in their places, then the straight run's other files.

    Returns the moves of the doctor's runs' files (from, to); OUT/files/moves.json lists them all."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [p for p in dict.fromkeys(written + [m["from"] for m in moves]) if Path(p).exists()]
    ours = [{"from": p, "to": str(folder / f"{i:03d}-{Path(p).name}")} for i, p in enumerate(paths)]
    ledger.write_text(json.dumps({"moves": moves + ours, "kept": kept}, indent=1))
    for move in ours:
        shutil.move(move["from"], move["to"])
    for index, (path, copy) in enumerate(kept.items()):
        if Path(path).exists():  # replaced by a file the doctor does not move (not a checkpoint)
            moved = {"from": path, "to": str(folder / f"replaced-{index:03d}-{Path(path).name}")}
            shutil.move(moved["from"], moved["to"])
            ours.append(moved)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(copy, path)
    for move in moves:
        if move["from"] not in kept:
            Path(move["from"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.move(move["aside"], move["from"])
    restored = [{"from": copy, "to": path, "restored": "was there before the doctor"} for path, copy in kept.items()]
    ledger.with_name("moves.json").write_text(json.dumps(moves + ours + restored, indent=1))
    ledger.unlink()
    return ours + restored
