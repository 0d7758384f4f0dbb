"""The doctor's three runs of the user's command, and the files between them (files.py).

straight     the command, cut as optimizer step STEPS+1 begins
interrupted  the command, ended as a crash would end it as the first step after a checkpoint
             saved at or after step STOP_AFTER begins (every file of that step is complete);
             under torchrun every rank ends at that step
resumed      the command with the resume arguments, cut after STEPS steps in all
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from exactresume.doctor.files import Ledger, put_back, recover, roots, set_aside, set_aside_earlier, unfinished
from exactresume.doctor.run import TracedRun, run_traced
from exactresume.doctor.warm import Launcher
from exactresume.errors import FieldError, UserError

MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


@dataclass
class Plan:
    command: list[str]
    resume_args: list[str]
    steps: int
    stop_after: int
    out: Path
    timeout: float | None = None
    warm: bool = False  # fork each run from one process that imported torch (warm.py)
    preload: tuple[str, ...] = ()  # modules that process imports too (the framework): implies warm

    def __post_init__(self) -> None:
        """Refuse counts the doctor cannot run, and what is not a module's name, named as fields (the command
        line names its flags)."""
        if not whole(self.steps) or self.steps < 2:
            raise FieldError(f"steps must be a whole number of at least 2, got {self.steps!r}", "steps")
        if not whole(self.stop_after) or not 1 <= self.stop_after < self.steps:
            message = f"stop_after must be between 1 and steps - 1 ({self.steps - 1}), got {self.stop_after!r}"
            raise FieldError(message, "stop_after", "steps")
        timeout = self.timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0):
            raise FieldError(f"timeout must be a number of seconds above 0, got {timeout!r}", "timeout")
        for name in self.preload:
            if not MODULE_NAME.fullmatch(name):
                raise FieldError(f"preload: {name!r} is not a module's name (e.g. transformers,accelerate)", "preload")
        self.warm = self.warm or bool(self.preload)


def module_names(text: str) -> tuple[str, ...]:
    """'transformers, accelerate' -> ('transformers', 'accelerate')."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class Runs:
    straight: TracedRun
    interrupted: TracedRun
    resumed: TracedRun
    resume_step: int
    files: list[dict]  # what the interrupted run left at the resume: path, step, keys, tensors
    moves: list[dict]


def examine(plan: Plan) -> Runs:
    if unfinished(plan.out):
        restored = [move for move in recover(plan.out) if "restored" in move]
        print(
            f"doctor: a doctor into {plan.out} stopped before its end: {len(restored)} path(s) its runs had moved "
            f"or changed are back as they were; its runs' files: {plan.out / 'previous' / 'files'}"
        )
    _keep_previous(plan.out)
    return _run_three(plan, Ledger(plan.out), Launcher(plan.warm, plan.out / "logs", plan.preload))


def _keep_previous(out: Path) -> None:
    """The files and traces of the previous doctor into OUT (all put back) into OUT/previous, out of this
    one's way: its moves would otherwise land in folders of the same names."""
    previous = out / "previous"
    if (out / "files").exists() or (out / "traces").exists():
        shutil.rmtree(previous, ignore_errors=True)
        previous.mkdir()
        for name in ("files", "traces"):
            if (out / name).exists():
                (out / name).rename(previous / name)


def _run_three(plan: Plan, ledger: Ledger, launcher: Launcher) -> Runs:
    def run(name: str, command: list[str], steps: int, crash_from: int | None = None, made=()) -> TracedRun:
        return run_traced(name, command, plan.out, steps, launcher, crash_from, plan.timeout, made)

    try:
        straight = run("straight", plan.command, plan.steps)
    except BaseException:  # stopped by --timeout or Ctrl-C: what it changed is put back from its trace
        recover(plan.out)
        raise
    aside = set_aside(ledger, straight)
    done: list[TracedRun] = []
    earlier: list[dict] = []
    try:
        _check_straight(straight, plan)
        interrupted = run("interrupted", plan.command, plan.steps, plan.stop_after)
        done.append(interrupted)
        resume_step = _check_interrupted(interrupted, plan)
        files = _read_files(interrupted, resume_step)
        steps, made = plan.steps - resume_step, roots([interrupted])
        earlier = set_aside_earlier(ledger, interrupted)
        resumed = run("resumed", plan.command + plan.resume_args, steps, made=made)
        done.append(resumed)
        _check_resumed(resumed, interrupted, plan)
    finally:
        moves = aside + earlier + put_back(ledger, straight, aside, done, earlier)
    return Runs(straight, interrupted, resumed, resume_step, files, moves)


def failed(run: TracedRun) -> bool:
    return not (run.cut or run.crashed or run.rc == 0)


def _check_straight(run: TracedRun, plan: Plan) -> None:
    if failed(run):
        raise UserError(run.failure())
    early = [load["path"] for load in run.loads if load["step"] == 0 and load["path"]]
    if early:
        raise UserError(f"the straight run was not fresh: it loaded {early[0]} before its first step; move it away")
    if not run.steps:
        raise UserError("the straight run took no optimizer step (the doctor counts torch.optim optimizers' step())")
    counts = {p.rank: len(p.steps) for p in run.stepping}
    if len(set(counts.values())) > 1:
        said = ", ".join(f"rank {rank} took {count}" for rank, count in counts.items())
        raise UserError(f"the ranks disagree on the step count in the straight run ({said} optimizer steps)")
    if len(run.steps) < plan.steps:
        raise UserError(
            f"the straight run ended after {len(run.steps)} optimizer steps, fewer than --steps {plan.steps}"
        )


def _check_interrupted(run: TracedRun, plan: Plan) -> int:
    if run.crashed:
        return max(save["step"] for save in run.saves)
    if failed(run):
        raise UserError(run.failure())
    saved = sorted({s["step"] for s in run.saves})
    at = f"step{'s' if len(saved) > 1 else ''} {', '.join(map(str, saved))}"
    said = f"it saved at {at}" if saved else "it saved nothing the doctor could see"
    raise UserError(
        f"the script saved no checkpoint at or after --stop-after {plan.stop_after} within {plan.steps} steps ({said})"
    )


def _check_resumed(run: TracedRun, interrupted: TracedRun, plan: Plan) -> None:
    if failed(run):
        raise UserError(run.failure())
    written = {s["path"] for s in interrupted.saves}
    if not any(load["path"] in written for load in run.loads):
        older = [load["path"] for load in run.loads if load["path"] and load["path"] not in interrupted.wrote]
        if older:
            raise UserError(
                f"the resumed run loaded none of the interrupted run's checkpoint files but {older[0]}, which was "
                "there before the doctor: if it is an older checkpoint, move it away or give the script a fresh "
                "output folder"
            )
        hint = (
            f"were the resume arguments {' '.join(plan.resume_args)!r} ignored?"
            if plan.resume_args
            else "no --resume-args were given: does the script need one to resume (--resume-args --resume)?"
        )
        raise UserError(f"the resumed run started at step 0: it loaded none of the checkpoint files; {hint}")
    if not run.steps:
        raise UserError("the resumed run took no optimizer step after loading its checkpoint")


def _read_files(run: TracedRun, step: int) -> list[dict]:
    """What each file saved at the resume step holds, read back as the resume reads it."""
    rows = []
    for process, save in ((p, s) for p in run.processes for s in p.saves):
        if save["step"] != step or not save["path"]:
            continue
        row = {
            k: save.get(k) for k in ("path", "step", "pending_micro", "live", "loaders", "held", "framework", "dropout")
        }
        row["rank"] = process.rank
        try:
            row |= _read_back(save["path"])
        except Exception as error:  # a file weights_only refuses: keep what torch.save was given
            row |= {"keys": save["keys"], "tensors": save["tensors"], "read": f"as saved ({type(error).__name__})"}
        rows.append(row)
    return rows


def _read_back(path: str) -> dict:
    """A file's top-level keys and tensors, read with weights_only=True; a DCP folder's entries, from its
    metadata."""
    import torch

    from exactresume.doctor.tracer.dcp import parts
    from exactresume.doctor.tracer.fingerprint import summary, top_keys

    if Path(path).is_dir():
        return parts(path) | {"read": ".metadata"}
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {"keys": top_keys(state), "tensors": summary(state), "read": "weights_only=True"}
