"""One doctor session: the three traced runs of a Plan, their verdict, and what it writes to OUT
(doctor.json, report.md, verdict.txt). `exactresume doctor` (commands/doctor.py) prints the verdict;
`check_resume` (check.py) returns it."""

from __future__ import annotations

import importlib
import threading
from dataclasses import asdict
from pathlib import Path

from exactresume.atomic import write_json
from exactresume.errors import UserError

# What the doctor itself needs once the runs are done (torch reads the checkpoint files, matplotlib draws).
VERDICT_MODULES = ("torch", "exactresume.doctor.diagnose", "exactresume.doctor.verdict")


def _import_quietly(modules: tuple[str, ...]) -> None:
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:  # imported again where it is used, and reported there
            return


def run_doctor(plan):
    """The three runs and their verdict, written to OUT (doctor.json, report.md, verdict.txt): the
    diagnosis and the verdict as the terminal shows it. `exactresume doctor` prints it; check.py returns it."""
    from exactresume.doctor.examine import examine

    # The doctor only waits while the user's command runs: import the verdict's modules meanwhile.
    imports = threading.Thread(target=_import_quietly, args=(VERDICT_MODULES,), name="doctor-imports")
    imports.start()
    try:
        runs = examine(plan)
    finally:
        imports.join()
    one_hash(runs)
    from exactresume.doctor.diagnose import diagnose
    from exactresume.doctor.verdict import terminal, write_report

    diagnosis = diagnose(runs)
    _write_facts(plan.out / "doctor.json", plan, runs, diagnosis)
    write_report(plan.out, plan, runs, diagnosis)
    text = terminal(plan, runs, diagnosis)
    (plan.out / "verdict.txt").write_text(text + "\n")
    return diagnosis, text


def one_hash(runs) -> None:
    """The three runs' fingerprints agree only when made with one hash (xxh3 where the command's Python has
    xxhash, BLAKE2b where it has not): refuse runs whose Python changed between them."""
    used = {name: getattr(runs, name).hashes for name in ("straight", "interrupted", "resumed")}
    if len(set().union(*used.values())) > 1:
        said = ", ".join(f"{' and '.join(sorted(hashes))} in the {name} run" for name, hashes in used.items())
        raise UserError(
            f"the runs hashed with different functions ({said}): was xxhash installed or removed meanwhile?"
        )


def _write_facts(path: Path, plan, runs, diagnosis) -> None:
    """doctor.json: the plan, the diagnosis and each run's facts, written atomically (atomic.write_json)."""

    def run_facts(run):
        return {
            "command": run.command,
            "exit_code": run.rc,
            "wall_s": round(run.wall_s, 3),
            "log": str(run.log),
            "forked_from": run.forked_from,
            "steps": run.steps,
            "saves": run.saves,
            "loads": run.loads,
            "ranks": {str(p.rank): {"pid": p.pid, "steps": len(p.steps), "end": p.end} for p in run.processes},
            "wrote": run.wrote,
        }

    facts = {
        "plan": {
            "command": plan.command,
            "resume_args": plan.resume_args,
            "steps": plan.steps,
            "stop_after": plan.stop_after,
        },
        "diagnosis": asdict(diagnosis) | {"exit_code": diagnosis.exit_code},
        "resume_step": runs.resume_step,
        "files": runs.files,
        "moves": runs.moves,
        "runs": {name: run_facts(getattr(runs, name)) for name in ("straight", "interrupted", "resumed")},
    }
    write_json(path, facts)
