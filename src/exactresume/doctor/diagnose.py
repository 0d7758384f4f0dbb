"""Align the runs step by step, find the first fingerprint where they part, and name the cause.

Steps 1..K of the interrupted run against the straight run are the determinism check; steps
K+1..N of the resumed run against the straight run are the resume check. A fingerprint that
differs between two fresh runs but never changes a result (an unseeded python `random` no one
draws from) is left out of the resume check, with a note. A fingerprint the tracer lost sight of (one
of its hooks failed in that run: tracer/guard.py) is compared in neither run from that step on, and
the verdict says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from exactresume.doctor.causes import Context, also, cause_of
from exactresume.doctor.examine import Runs
from exactresume.doctor.fixes import fix_for, framework_fix
from exactresume.doctor.random_sources import describe, fix, parted
from exactresume.doctor.ranks import diagnose_ranks
from exactresume.doctor.tracer.sources import PREFIX

FIELDS = ("batch", "indices", "lr", "hparams", "params", "grads", "optim", "scaler", "data", "layout", "buffers")
RNG_FIELDS = ("rng_torch", "rng_cuda", "rng_numpy", "rng_python")
DECISIVE = ("batch", "lr", "hparams", "params", "grads", "optim")
# states that change a step only through what it draws or reads (the batch, a dropout, a running statistic),
# and the optimizer's order of the same parameters, which changes a step only through where its state lands
# (the samples read show in the batch: the batch decides)
AHEAD = {"data", "layout", "buffers", "indices", *RNG_FIELDS}
NAMES = {
    "batch": "batch",
    "indices": "samples read",
    "lr": "lr",
    "hparams": "optimizer hyperparameters",
    "params": "weights before the step",
    "grads": "gradients",
    "optim": "optimizer state after the step",
    "scaler": "GradScaler state",
    "data": "DataLoader sampler state",
    "layout": "optimizer's parameter order",
    "buffers": "model's buffers",
    "rng_torch": "torch RNG",
    "rng_cuda": "CUDA RNG",
    "rng_numpy": "numpy RNG",
    "rng_python": "python RNG",
}


def name_of(field: str) -> str:
    """What a fingerprint is, in the user's words: 'gradients', 'the random.Random sampler.rng'."""
    return NAMES.get(field) or describe(field)


@dataclass
class Diagnosis:
    verdict: str  # exact | diverges | not_deterministic
    cause: str
    headline: str
    resume_step: int
    first_step: int | None = None
    differs: list[str] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unseeded: list[str] = field(default_factory=list)  # fingerprints two fresh runs already disagree on
    missing: list[dict] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)  # what to change, in the framework's words
    causes: list[str] = field(default_factory=list)  # every cause that parts at the first step, the data first
    equal: dict[str, list[bool | None]] = field(default_factory=dict)  # field -> per straight step 1..N (None: lost)
    lost: list[dict] = field(default_factory=list)  # what the tracer lost sight of: run, what, step, fields, error
    distance: list[float | None] = field(default_factory=list)  # weight sample max |a - b| per step

    @property
    def exit_code(self) -> int:
        return 0 if self.verdict == "exact" else 1


def differing(a: dict, b: dict, fields) -> list[str]:
    """The fields whose fingerprints differ; a random source of the script's own only where both records hold
    it (one a run made later, or whose fingerprint the tracer lost at that step, is not compared)."""
    return [f for f in fields if a.get(f) != b.get(f) and (not f.startswith(PREFIX) or (f in a and f in b))]


def diagnose(runs: Runs) -> Diagnosis:
    """The verdict: for one process, or rank by rank under torchrun (ranks.py)."""
    if len(runs.straight.stepping) > 1:
        return diagnose_ranks(runs, diagnose_one)
    return diagnose_one(runs)


def diagnose_one(runs: Runs) -> Diagnosis:
    runs, blind, lost = _blinded(runs)
    straight, interrupted, resumed, k = (
        runs.straight.steps,
        runs.interrupted.steps,
        runs.resumed.steps,
        runs.resume_step,
    )
    sources = dict.fromkeys(f for s in straight for f in s if f.startswith(PREFIX))  # each source, as first seen
    fields = FIELDS + tuple(f for f in RNG_FIELDS if any(f in s for s in straight)) + tuple(sources)
    unseeded = [
        f for f in fields if f not in DECISIVE and any(differing(a, b, [f]) for a, b in zip(straight, interrupted[:k]))
    ]
    kept = tuple(f for f in fields if f not in unseeded)
    notes = [
        f"the {name_of(f)} differs between two fresh runs (not seeded); it is left out of the comparison"
        for f in unseeded
    ]
    pairs = list(zip(straight, interrupted[:k])) + list(zip(straight[k:], resumed))
    equal = {f: [None if (f, p) in blind else a.get(f) == b.get(f) for p, (a, b) in enumerate(pairs)] for f in fields}
    notes += [_lost_note(row) for row in lost]
    diagnosis = first_difference(runs, kept, notes) or Diagnosis(
        "exact",
        "exact",
        f"exact: steps {k + 1}..{k + len(resumed)} are bit-identical to the straight run{_unseen(lost, k)}",
        k,
        notes=notes,
    )
    diagnosis.equal, diagnosis.distance, diagnosis.unseeded = equal, distances(runs), unseeded
    diagnosis.lost = lost
    framework = next((f["framework"] for f in runs.files if f.get("framework")), None)
    diagnosis.missing = _restored_left_out(_missing_state(runs, framework), equal, k) + _unrestored(diagnosis)
    if diagnosis.verdict == "exact":  # the resume needed none of it in the steps compared: no fix to make
        diagnosis.notes += [
            f"not in the checkpoint, not needed in the steps compared: {r['name']}" for r in diagnosis.missing
        ]
        diagnosis.missing = []
    said = {row["fix"] for row in diagnosis.missing}
    fixes = [framework_fix(c, framework) or (None if said else fix_for(c, None)) for c in diagnosis.causes]
    diagnosis.fixes = [fix for fix in dict.fromkeys(fixes) if fix and fix not in said]
    if len(resumed) < len(straight) - k:
        diagnosis.notes.append(
            f"the resumed run took only {len(resumed)} of the {len(straight) - k} steps after the resume"
        )
    return diagnosis


def first_difference(runs: Runs, fields: tuple, notes: list[str]) -> Diagnosis | None:
    straight, interrupted, k = runs.straight.steps, runs.interrupted.steps, runs.resume_step
    for index, (a, b) in enumerate(zip(straight, interrupted[:k])):
        diff = differing(a, b, DECISIVE)
        if diff:
            return not_deterministic(index + 1, diff, k, notes)
    ahead, early = None, []  # the first step where only a sampler's or an RNG's state differs, and which
    for index, (a, b) in enumerate(zip(straight[k:], runs.resumed.steps)):
        diff = differing(a, b, fields)
        if diff and all(f in AHEAD or f.startswith(PREFIX) for f in diff):  # shows in a later batch or forward
            ahead, early = ahead or k + index + 1, early + [f for f in diff if f not in early]
            continue
        if diff:
            return _resume_difference(Context(runs, index, a, b, diff, ahead), notes)
    if "buffers" in early:  # the resumed model holds other buffers, whatever the steps compared show
        index = ahead - runs.resume_step - 1
        return _resume_difference(Context(runs, index, straight[ahead - 1], runs.resumed.steps[index], early), notes)
    if ahead:
        said = " and ".join(f"the {name_of(f)}" for f in early) + (" differs" if len(early) == 1 else " differ")
        notes.append(
            f"{said} from step {ahead}, though every step compared is bit-identical: a later step that draws "
            "from it would part"
        )
    return None


def _resume_difference(context: Context, notes: list[str]) -> Diagnosis:
    """The causes of the first resumed step that parts (the data first, then the forward's randomness)."""
    cause, headline, evidence = cause_of(context)
    causes = [cause]
    second = also(context, cause)
    if second:
        causes.append(second[0])
        headline, evidence = f"{headline}; and {second[1]}", evidence + second[2]
    evidence = [f"differs at step {context.step}: " + ", ".join(name_of(f) for f in context.diff)] + evidence
    diagnosis = Diagnosis("diverges", cause, headline, context.runs.resume_step, context.step, context.diff, evidence)
    diagnosis.notes, diagnosis.causes = notes, causes
    return diagnosis


def not_deterministic(step: int, diff: list[str], k: int, notes: list[str]) -> Diagnosis:
    if "params" in diff and step == 1:
        why = "the initial weights differ: the model's initialization is not seeded"
    elif "batch" in diff:
        why = "the batch differs: the data order is not seeded"
    elif "grads" in diff:
        why = "the same batch and weights give other gradients: an unseeded dropout, a non-deterministic kernel"
        why += " or another thread count"
    else:
        why = f"the {name_of(diff[0])} differs"
    headline = f"not deterministic even without a resume: two fresh runs part at step {step} ({why})"
    evidence = [f"differs at step {step}: " + ", ".join(name_of(f) for f in diff)]
    return Diagnosis("not_deterministic", "not_deterministic", headline, k, step, diff, evidence, notes)


def distances(runs: Runs) -> list[float | None]:
    """Max |straight - other| over the weight sample, per straight step (interrupted to K, then resumed)."""
    k = runs.resume_step
    straight, interrupted, resumed = runs.straight.weights, runs.interrupted.weights, runs.resumed.weights
    rows: list[float | None] = []
    for step in range(len(runs.straight.steps)):
        other, at = (interrupted, step) if step < k else (resumed, step - k)
        if straight is None or other is None or at >= len(other) or other.shape[1] != straight.shape[1]:
            rows.append(None)
        else:
            found = float(np.max(np.abs(straight[step] - other[at]), initial=0.0))
            rows.append(None if np.isnan(found) else found)  # NaN: a sample the tracer lost (or NaN weights)
    return rows


def _blinded(runs: Runs) -> tuple[Runs, set[tuple[str, int]], list[dict]]:
    """The runs with each fingerprint a run lost sight of set to "lost" in both runs of every pair compared
    from that step on; the (field, straight step index) pairs left out; and what was lost, where (steps
    counted as the straight run counts them: the resumed run's own step 1 is step K+1)."""
    k, blind, lost = runs.resume_step, set(), []
    named = {"straight": runs.straight, "interrupted": runs.interrupted, "resumed": runs.resumed}
    for name, run in named.items():
        offset = k if name == "resumed" else 0
        for process in run.processes:
            for event in process.lost:
                facts = {key: value for key, value in event.items() if key != "event"}
                lost.append({"run": name, "rank": process.rank} | facts | {"step": event["step"] + offset})
                if process is run.first:
                    first = event["step"] + offset - 1  # as an index of the straight run's steps
                    span = range(first, k) if name == "interrupted" else range(first, len(runs.straight.steps))
                    blind |= {(f, p) for f in event["fields"] for p in span}
    if not blind:
        return runs, blind, lost
    steps = {name: [dict(step) for step in run.steps] for name, run in named.items()}
    for f, p in blind:
        partner, at = ("interrupted", p) if p < k else ("resumed", p - k)
        if at < len(steps[partner]) and (f in steps["straight"][p] or f in steps[partner][at]):
            steps["straight"][p][f] = steps[partner][at][f] = "lost"
    views = {
        name: replace(run, processes=[replace(p, steps=steps[name]) if p is run.first else p for p in run.processes])
        for name, run in named.items()
    }
    return replace(runs, **views), blind, lost


def _lost_note(row: dict) -> str:
    where = f"step {row['step']} of the {row['run']} run" + (
        f" (rank {row['rank']})" if row["rank"] is not None else ""
    )
    compared = ", ".join(name_of(f) for f in row["fields"] if f in NAMES)
    after = f": the {compared} not compared from there" if compared else ""
    return f"the doctor lost sight of {row['what']} from {where} ({row['error']}){after}"


def _unseen(lost: list[dict], k: int) -> str:
    """What an exact verdict could not see: the fingerprints lost in the steps it compares (the notes list them)."""
    seen = [row for row in lost if row["fields"] and (row["run"] != "interrupted" or row["step"] <= k)]
    if not seen:
        return ""
    blind = {f for row in seen for f in row["fields"]}
    fields = [name for f, name in NAMES.items() if f in blind]
    said = ", ".join(fields[:3]) + (f" and {len(fields) - 3} more" if len(fields) > 3 else "")
    return f", in what the doctor could compare: it lost sight of the {said} from step {min(r['step'] for r in seen)}"


FIXES = {
    "model": "save model.state_dict() as it is (fp32), and load it back with model.load_state_dict()",
    "optimizer": "save optimizer.state_dict() and call optimizer.load_state_dict() on resume",
    "lr_scheduler": "save scheduler.state_dict() and call scheduler.load_state_dict() on resume",
    "grad_scaler": "save scaler.state_dict() and call scaler.load_state_dict() on resume",
    "generator": "save the generator's get_state() at the epoch's start and set_state() it before iterating",
    "global_rng": "save torch.get_rng_state() (and the numpy, python, CUDA states) and set them on resume",
    "stream": fix_for("stream_position_lost", None),
    "stream_rng": "save the generator's get_state() with the stream's position and set_state() it on resume",
}
STORE_FIX = "or make it a part of exactresume's CheckpointStore"


KIND_CAUSES = {"global_rng": "rng_lost", "lr_scheduler": "scheduler_lost", "generator": "data_position_lost"}
KIND_CAUSES |= {"stream": "stream_position_lost", "stream_rng": "stream_rng_lost"}


# The fingerprint that shows whether a live object of a kind was restored, whatever the files hold
RESTORED_BY = {"generator": "data", "global_rng": "rng_torch"}
# The causes that name a random source the resume did not restore (random_sources.py)
SOURCE_CAUSES = ("data_position_lost", "augmentation_rng_lost")


def _restored_left_out(rows: list[dict], equal: dict[str, list[bool | None]], k: int) -> list[dict]:
    """`rows` less those whose state no file holds but the resume rebuilt (a generator reseeded from the seed
    and the epoch): their fingerprint is the straight run's at every resumed step."""
    restored = {kind for kind, f in RESTORED_BY.items() if f in equal and all(e is not False for e in equal[f][k:])}
    return [row for row in rows if row["kind"] not in restored]


def _unrestored(diagnosis: Diagnosis) -> list[dict]:
    """The random source the cause names (the first of the script's own that parts, else a global one other
    than torch's, which the files' rows name), with the fix in its own API."""
    if diagnosis.cause not in SOURCE_CAUSES:
        return []
    named = [f for f in parted(diagnosis.differs) if f != "rng_torch" and describe(f) in diagnosis.headline][:1]
    detail = f"its state is not the straight run's at step {diagnosis.first_step}: the resume did not restore it"
    return [
        {"kind": "random_source", "name": describe(f), "saved": False, "detail": detail, "fix": fix(f)} for f in named
    ]


def _missing_state(runs: Runs, framework: str | None = None) -> list[dict]:
    """Each live stateful object whose state none of the files saved at the resume step holds, with
    its fix (in the framework's words where it has its own)."""
    saved, rows = set(), {}
    for file in runs.files:
        for row in file["live"] or []:
            key = (row["kind"], row["name"])
            if row["saved"] or row["kind"] == "forward_module":  # named by the cause only where the forward part
                saved.add(key)
                continue
            fix = framework_fix(KIND_CAUSES.get(row["kind"], ""), framework)
            fix = fix or FIXES.get(row["kind"], "save its state_dict()") + ", " + STORE_FIX
            rows.setdefault(key, row | {"fix": fix})
    return [row for key, row in rows.items() if key not in saved]
