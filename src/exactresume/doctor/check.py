"""`check_resume`: the doctor as a call, for a test that asserts a training script resumes exactly.

    check = check_resume([sys.executable, "train.py"], steps=8, stop_after=4, resume_args=["--resume"])
    assert check.exact, check

It runs what `exactresume doctor` runs (session.py's `run_doctor`: the three traced runs, the verdict,
OUT's files) and returns the verdict doctor.json holds as a `ResumeCheck`, instead of printing it.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from exactresume.doctor.session import run_doctor
from exactresume.errors import UserError, a_kind_of, extras_needed


@dataclass(frozen=True)
class ResumeCheck:
    """The doctor's verdict on one command. `str()` is the verdict as `exactresume doctor` prints it,
    the headline first: what a failed `assert check.exact, check` shows."""

    exact: bool  # the resumed steps are bit-identical to the straight run's
    verdict: str  # exact | diverges | not_deterministic (two fresh runs already part: no resume to blame)
    cause: str  # "exact", or the first cause named: rng_lost, optimizer_lost, data_position_lost, ...
    causes: tuple[str, ...]  # every cause that parts at the first step, the data first
    headline: str
    first_step: int | None  # the first step where the resumed (or interrupted) run parts from the straight one
    resume_step: int  # the step of the checkpoint the resumed run started from
    missing: tuple[str, ...]  # live state the checkpoint lacks, by name (CosineAnnealingLR, ...)
    fixes: tuple[str, ...]  # what to change; none under an exact verdict
    folder: Path  # the doctor's output: doctor.json, report.md, doctor.png, verdict.txt, logs/, files/
    text: str = field(repr=False)

    def __str__(self) -> str:
        return self.text


def check_resume(
    command: Sequence[str | os.PathLike] | str,
    *,
    steps: int,
    stop_after: int,
    resume_args: Sequence[str | os.PathLike] | str = (),
    out: str | os.PathLike | None = None,
    timeout: float | None = None,
    warm: bool = False,
    preload: Sequence[str] | str = (),
) -> ResumeCheck:
    """Run `command` straight for `steps` optimizer steps, interrupted after its first checkpoint at or
    after step `stop_after`, and resumed with `resume_args` added, each under the doctor's tracer; the
    verdict. `out`: the doctor's folder (a new one in the temp folder when None); `warm`: fork each run
    of `python SCRIPT` from one process that imported torch once (`exactresume doctor --warm`);
    `preload`: modules that process imports too, e.g. ("transformers",) (`--preload`; implies `warm`).
    Bad arguments, and a command the doctor cannot judge, raise UserError (one line)."""
    lab_installed()
    plan = _plan_of(command, steps, stop_after, resume_args, out, timeout, warm, preload)
    diagnosis, text = run_doctor(plan)
    fixes = [row["fix"] for row in diagnosis.missing] + list(diagnosis.fixes)
    return ResumeCheck(
        exact=diagnosis.verdict == "exact",
        verdict=diagnosis.verdict,
        cause=diagnosis.cause,
        causes=tuple(diagnosis.causes),
        headline=diagnosis.headline,
        first_step=diagnosis.first_step,
        resume_step=diagnosis.resume_step,
        missing=tuple(row["name"] for row in diagnosis.missing),
        fixes=tuple(dict.fromkeys(fixes)),  # one line per fix, in the order the verdict says them
        folder=plan.out,
        text=text,
    )


def _plan_of(command, steps, stop_after, resume_args, out, timeout, warm, preload):
    """The doctor's plan, refusing what `exactresume doctor` refuses in its flags, in the call's words."""
    from exactresume.doctor.examine import Plan

    words, resume, modules = argv("command", command), argv("resume_args", resume_args), _modules(preload)
    if not words:
        raise UserError("check_resume: command is empty; give the training command, e.g. [sys.executable, 'train.py']")
    try:  # the plan checks its counts itself, before a folder is made
        Plan(words, resume, steps, stop_after, Path(tempfile.gettempdir()), timeout, warm, modules)
    except UserError as error:
        raise UserError(f"check_resume: {error}") from None
    if not isinstance(warm, bool):
        raise UserError(f"check_resume: warm must be True or False, got {warm!r}")
    if out is not None and not isinstance(out, str | os.PathLike):
        raise UserError(f"check_resume: out must be a folder's path, got {a_kind_of(out)}")
    folder = Path(tempfile.mkdtemp(prefix="exactresume-doctor-") if out is None else out)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"check_resume: out {str(folder)!r} is a file, not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    return Plan(words, resume, steps, stop_after, folder.resolve(), timeout, warm, modules)


def _modules(preload) -> tuple[str, ...]:
    """Module names: a list or tuple of strings, or one string of names separated by commas."""
    from exactresume.doctor.examine import module_names

    if isinstance(preload, str):
        if not (names := module_names(preload)):
            raise UserError(f"check_resume: preload {preload!r} names no module, e.g. 'transformers,accelerate'")
        return names
    if not isinstance(preload, list | tuple):
        raise UserError(f"check_resume: preload must be a list of module names, got {a_kind_of(preload)}")
    for name in preload:
        if not isinstance(name, str):
            raise UserError(f"check_resume: preload must hold module names (strings), not {a_kind_of(name)}")
    return tuple(preload)


def lab_installed() -> None:
    """The verdict draws with the lab extra's numpy and matplotlib: say so before the runs, not after."""
    with extras_needed():
        for module in ("numpy", "matplotlib"):
            if importlib.util.find_spec(module) is None:
                raise ModuleNotFoundError(f"No module named {module!r}", name=module)


def argv(name: str, value) -> list[str]:
    """A command's words: a list or tuple of strings (or paths), or one string split as a shell would."""
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as error:
            raise UserError(f"check_resume: {name}: {error}") from None
    if isinstance(value, list | tuple) and all(isinstance(word, str | os.PathLike) for word in value):
        return [os.fspath(word) for word in value]
    raise UserError(f"check_resume: {name} must be a list of strings or one string, got {a_kind_of(value)}")
