"""The verdict: on the terminal (and OUT/verdict.txt), in OUT/report.md, and in OUT/doctor.png.

The figure's top panel is the step x fingerprint map (equal / different; steps 1..K compare the
interrupted run with the straight one, steps K+1..N the resumed one); the bottom panel is the
largest weight difference over a fixed sample of about 4096 weights (of the eight largest
parameters), per step, zeros drawn on a floor line of their own.
"""

from __future__ import annotations

import io
import shlex
from pathlib import Path

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure

from exactresume.atomic import atomic_write_bytes
from exactresume.doctor.diagnose import name_of
from exactresume.errors import listed

FLOOR = 1e-12


def terminal(plan, runs, diagnosis) -> str:
    """The verdict as the terminal shows it: the headline, its evidence, the missing state, where the files are."""
    lines = [f"doctor: {diagnosis.headline}"]
    lines += [f"  evidence: {line}" for line in diagnosis.evidence]
    lines += [f"  missing from the checkpoint: {r['name']} ({r['detail']}); fix: {r['fix']}" for r in diagnosis.missing]
    lines += [f"  fix: {line}" for line in diagnosis.fixes]
    lines += [f"  note: {line}" for line in diagnosis.notes if "not seeded" not in line]
    roots = [Path(m["to"]) for m in runs.moves if m.get("run") == "straight, put back"]
    files = sorted({shown(root if root.is_dir() else root.parent) for root in roots})
    if files:
        lines.append(f"  the straight run's files are back where the script wrote them, in {', '.join(files)}")
    restored = [m for m in runs.moves if m.get("restored") == "was there before the doctor"]
    if restored:
        lines.append(
            f"  {len(restored)} path(s) there before the doctor, changed by its runs, are back as they were; "
            f"the straight run's versions: {shown(plan.out / 'files' / 'straight')}"
        )
    earlier = [shown(Path(m["from"])) for m in runs.moves if m.get("run") == "earlier"]
    if earlier:
        lines.append(
            f"  {listed(earlier)}, an earlier run's checkpoints beside the interrupted run's, were set aside for "
            "the resume (it would have found them) and are back"
        )
    lines.append(
        f"  the doctor's runs' files: {shown(plan.out / 'files' / 'resumed')}; details: {shown(plan.out / 'report.md')}"
    )
    return "\n".join(lines)


def shown(path: Path) -> str:
    """A path relative to the working folder when it is inside it."""
    try:
        return str(Path(path).relative_to(Path.cwd())) or "."
    except ValueError:
        return str(path)


LABELS_INCHES = 2.4  # the row names of the figure's grid, at 8 points


def draw(diagnosis) -> Figure:
    fields = list(diagnosis.equal)
    steps = len(next(iter(diagnosis.equal.values()), []))
    ignored = set(diagnosis.unseeded)
    grid = np.array(
        [[2 if f in ignored or ok is None else (0 if ok else 1) for ok in diagnosis.equal[f]] for f in fields],
        dtype=float,
    ).reshape(len(fields), steps)
    width = max(6.5, 0.35 * steps + 3.5)
    figure = Figure(figsize=(width, 5.5))
    # A fixed margin wide enough for the longest row name: a layout engine would cost the doctor a second.
    figure.subplots_adjust(left=LABELS_INCHES / width, right=0.97, top=0.93, bottom=0.1, hspace=0.12)
    top, bottom = figure.subplots(2, 1, height_ratios=(3, 2), sharex=True)
    colours = ListedColormap(["#4caf50", "#e53935", "#bdbdbd"])
    extent = (0.5, steps + 0.5, len(fields) - 0.5, -0.5)
    top.imshow(grid, aspect="auto", cmap=colours, vmin=0, vmax=2, extent=extent, interpolation="nearest")
    labels = [name_of(f) + (" (not seeded)" if f in ignored else "") for f in fields]
    top.set_yticks(range(len(fields)), labels, fontsize=8)
    figure.suptitle("vs the straight run: equal (green), different (red), ignored or lost (grey)", fontsize=10)
    distance = [FLOOR if d == 0 else (np.nan if d is None else d) for d in diagnosis.distance]
    xs = np.arange(1, len(distance) + 1)
    bottom.semilogy(xs, distance, marker="o", color="#1f77b4")
    bottom.axhline(FLOOR, color="grey", linewidth=0.6)
    bottom.text(1, FLOOR * 2, "bit-identical", fontsize=7, color="grey")
    bottom.set_ylabel("max |w - w_straight|\n(weight sample)")
    bottom.set_xlabel("optimizer step")
    for axis in (top, bottom):
        axis.axvline(diagnosis.resume_step + 0.5, color="black", linestyle="--", linewidth=1)
    bottom.text(diagnosis.resume_step + 0.6, FLOOR * 10, "resume", fontsize=8)
    return figure


def _save_png(figure: Figure, path: Path) -> None:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    atomic_write_bytes(path, buffer.getvalue())


def markdown(plan, runs, diagnosis) -> str:
    command = shlex.join(plan.command)
    lines = [
        "# exactresume doctor",
        "",
        f"`{command}`, {plan.steps} steps, interrupted after the checkpoint of step {runs.resume_step}, "
        f"resumed with `{shlex.join(plan.resume_args)}`.",
        "",
        f"**{diagnosis.headline}**",
        "",
    ]
    lines += [f"- {line}" for line in diagnosis.evidence + diagnosis.notes]
    if diagnosis.missing:
        lines += ["", "## Live state missing from the checkpoint", "", "| object | why | fix |", "|---|---|---|"]
        lines += [f"| {r['name']} ({r['kind']}) | {r['detail']} | {r['fix']} |" for r in diagnosis.missing]
    lines += ["", "## The checkpoint at the resume", ""]
    for file in runs.files:
        tensors = ", ".join(f"{t['key']} {t['dtype'].removeprefix('torch.')} {t['shape']}" for t in file["tensors"][:8])
        lines.append(f"- `{file['path']}` (read {file['read']}): keys {', '.join(file['keys'][:12])}; {tensors}")
    lines += ["", "## Steps", "", "![fingerprints and weight distance](doctor.png)", "", _step_table(diagnosis)]
    lines += ["", "## Runs and files", ""]
    for name in ("straight", "interrupted", "resumed"):
        run = getattr(runs, name)
        lines.append(f"- {name}: {len(run.steps)} steps, exit code {run.rc}, {run.wall_s:.1f} s, output in `{run.log}`")
    lines += [f"- `{m['from']}` → `{m['to']}`" for m in runs.moves if m.get("run") not in ("straight", "earlier")]
    return "\n".join(lines) + "\n"


def _step_table(diagnosis) -> str:
    steps = len(next(iter(diagnosis.equal.values()), []))
    head = "| fingerprint | " + " | ".join(str(s) for s in range(1, steps + 1)) + " |"
    rule = "|---|" + "---|" * steps
    rows = [
        f"| {name_of(f)} | " + " | ".join("?" if ok is None else ("=" if ok else "**≠**") for ok in oks) + " |"
        for f, oks in diagnosis.equal.items()
    ]
    return "\n".join([head, rule, *rows])


def write_report(out: Path, plan, runs, diagnosis) -> None:
    _save_png(draw(diagnosis), out / "doctor.png")
    atomic_write_bytes(out / "report.md", markdown(plan, runs, diagnosis).encode())
