"""Under torchrun: the three runs compared rank by rank, and the rank that parts first named.

Each rank is diagnosed on its own (its steps in the straight, interrupted and resumed runs). Where
several part at the same step, the one whose difference comes first in the chain of cause and
effect is named (a batch before the gradients DDP averages from it, say), with what the others
show. A rank that saved no file of its own is judged against the files the other ranks saved: its
sampler's generator counts as saved only when one of them holds that rank's state bytes.
"""

from __future__ import annotations

from dataclasses import replace

from exactresume.doctor.examine import Runs
from exactresume.doctor.run import TracedRun

ORDER = ("batch", "lr", "hparams", "params", "rng_torch", "rng_cuda", "data", "grads", "optim", "scaler")


def ranks(runs: Runs) -> list[int | None]:
    return [process.rank for process in runs.straight.stepping]


def _rank_view(runs: Runs, index: int) -> Runs:
    """The runs as the `index`-th stepping process (in rank order) saw them."""

    def alone(run: TracedRun) -> TracedRun:
        return replace(run, processes=run.stepping[index : index + 1])

    rank = runs.straight.stepping[index].rank
    own = [f for f in runs.files if f.get("rank") == rank]
    files = own or _borrowed(runs, index)
    return replace(
        runs,
        straight=alone(runs.straight),
        interrupted=alone(runs.interrupted),
        resumed=alone(runs.resumed),
        files=files,
    )


def _borrowed(runs: Runs, index: int) -> list[dict]:
    """The other ranks' files at the resume step, with this rank's own sampler generators and loader."""
    if index >= len(runs.interrupted.stepping):
        return runs.files
    process, k = runs.interrupted.stepping[index], runs.resume_step
    held = {state for f in runs.files for state in f.get("held") or []}
    now = process.steps[k - 1].get("generators", []) if 0 < k <= len(process.steps) else []
    starts = [e["generators"] for e in process.events if e["event"] == "iter" and e["step"] < k] or [[]]
    rows = []
    for position, state in enumerate(now):
        found = state in held or (position < len(starts[-1]) and starts[-1][position] in held)
        detail = "" if found else f"no file holds rank {process.rank}'s generator state (get_state())"
        name = f"rank {process.rank}'s sampler generator"
        rows.append({"kind": "generator", "name": name, "saved": found, "detail": detail})
    loaders = [e["loader"] for e in process.events if e["event"] == "loader" and e["step"] < k][-1:]
    shared = [dict(r) for f in runs.files[:1] for r in f["live"] or [] if r["kind"] != "generator"]
    return [f | {"live": shared + rows, "loaders": loaders or f["loaders"]} for f in runs.files[:1]]


def _first_part(diagnosis, rank) -> tuple:
    """Sort key: the earliest step, then the most upstream fingerprint, then the lowest rank."""
    if diagnosis.first_step is None:
        return (float("inf"), len(ORDER), rank or 0)
    upstream = min((ORDER.index(f) for f in diagnosis.differs if f in ORDER), default=len(ORDER))
    return (diagnosis.first_step, upstream, rank or 0)


def diagnose_ranks(runs: Runs, diagnose_one):
    """Every rank diagnosed; the one that parts first, named, with the others in the evidence."""
    found = [(rank, diagnose_one(_rank_view(runs, index))) for index, rank in enumerate(ranks(runs))]
    rank, chosen = min(found, key=lambda pair: _first_part(pair[1], pair[0]))
    world = len(found)
    if chosen.verdict == "exact":
        chosen.headline = f"{chosen.headline}, on every rank ({world})"
        return chosen
    chosen.headline = f"on rank {rank} (of {world}): {chosen.headline}"
    for other, diagnosis in found:
        if other != rank:
            chosen.evidence.append(f"rank {other}: {_rank_line(diagnosis)}")
    return chosen


def _rank_line(diagnosis) -> str:
    if diagnosis.first_step is None:
        return "bit-identical to its straight run"
    return diagnosis.evidence[0] if diagnosis.evidence else f"parts at step {diagnosis.first_step}"
