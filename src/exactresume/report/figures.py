"""The report's figures, drawn from the files a lab run wrote (matplotlib, Agg, PNG beside report.md).

    loss_curves.png  the four runs' training loss, the stop marked
    loss_diff.png    |loss - straight| per step on a log axis, exact zeros in a row of their own
    divergence.png   weight distance to the uninterrupted run after every resumed step (noopt, noskip)
    sizes.png        the resume file by part next to the fp32 and fp16 weights files

Text inside the images is English (the fonts at hand have no Korean or Chinese glyphs); the
report's captions carry the languages. Figures are built as `matplotlib.figure.Figure` objects, not
through pyplot, so drawing them touches no global backend or figure registry.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from matplotlib.figure import Figure

from exactresume.atomic import atomic_write_bytes
from exactresume.core.steplog import read_divergence, read_loss_log

DETAILS = "details"
FIGURES = ("loss_curves", "loss_diff", "divergence", "sizes")
ABLATIONS = ("noopt", "noskip")
STYLE = {  # one colour per run in every figure
    "straight": {"color": "#1f77b4", "label": "straight (uninterrupted)"},
    "resumed": {"color": "#ff7f0e", "label": "resumed (all parts restored)"},
    "noopt": {"color": "#d62728", "label": "noopt (optimizer state dropped)"},
    "noskip": {"color": "#2ca02c", "label": "noskip (batch generator reseeded)"},
}
LOG_RESOLUTION = 1e-6  # losses are logged with 6 decimals
MB = 1e6
STEP_LABEL = "optimizer step"
LOSS_UNIT = "nats/token"


def figure_path(folder: Path, name: str) -> Path:
    return Path(folder) / f"{name}.png"


def _loss_logs(folder: Path) -> dict[str, dict[int, float]]:
    paths = {
        "straight": folder / "straight_log.csv",
        "resumed": folder / "resumed_log.csv",
        "noopt": folder / DETAILS / "noopt_log.csv",
        "noskip": folder / DETAILS / "noskip_log.csv",
    }
    return {name: {step: float(loss) for step, loss in read_loss_log(path).items()} for name, path in paths.items()}


def _mark_stop(axis, stop_at: int) -> None:
    axis.axvline(stop_at, color="0.35", linestyle=":", linewidth=1.2)
    axis.annotate(
        f"stop after step {stop_at}",
        xy=(stop_at, 1.0),
        xycoords=("data", "axes fraction"),
        xytext=(4, -14),
        textcoords="offset points",
        fontsize=9,
        color="0.25",
    )


def loss_curves(logs: dict[str, dict[int, float]], stop_at: int) -> Figure:
    """The four runs' loss on one axis; resumed drawn as markers so it shows on top of straight."""
    figure = Figure(figsize=(8, 4.6), layout="constrained")
    axis = figure.subplots()
    for name, log in logs.items():
        steps, losses = list(log), list(log.values())
        if name == "resumed":
            axis.plot(
                steps, losses, linestyle="none", marker="o", markersize=4.5, markerfacecolor="none", **STYLE[name]
            )
        else:
            axis.plot(steps, losses, linewidth=2.2 if name == "straight" else 1.3, **STYLE[name])
    _mark_stop(axis, stop_at)
    axis.set_xlabel(STEP_LABEL)
    axis.set_ylabel(f"training loss ({LOSS_UNIT})")
    axis.set_title("Training loss: uninterrupted, resumed, and resumed with one part missing")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=9)
    return figure


def loss_diff(loss_diffs: dict[str, list[dict]], stop_at: int, steps: int) -> Figure:
    """|loss - straight| on a log axis; exact zeros, which a log axis cannot show, in a row below it."""
    figure = Figure(figsize=(8, 5.2), layout="constrained")
    top, bottom = figure.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [4, 1.3]})
    names = list(loss_diffs)
    for row, name in enumerate(names):
        nonzero = [(d["step"], abs(d["diff"])) for d in loss_diffs[name] if d["diff"] != 0]
        zero = [d["step"] for d in loss_diffs[name] if d["diff"] == 0]
        if nonzero:
            top.plot(*zip(*nonzero), marker=".", linewidth=1.2, **STYLE[name])
        else:
            top.plot([], [], marker="o", markerfacecolor="none", linestyle="none", **STYLE[name])
        bottom.plot(
            zero, [row] * len(zero), linestyle="none", marker="o", markerfacecolor="none", color=STYLE[name]["color"]
        )
    top.set_yscale("log")
    top.axhline(LOG_RESOLUTION, color="0.5", linewidth=0.8, linestyle="--")
    top.annotate(
        "log resolution (6 decimals)",
        xy=(1.0, LOG_RESOLUTION),
        xycoords=("axes fraction", "data"),
        xytext=(-4, 3),
        textcoords="offset points",
        ha="right",
        fontsize=8,
        color="0.4",
    )
    top.set_ylabel(f"|loss - straight loss| ({LOSS_UNIT})")
    top.set_title(f"Loss difference to the uninterrupted run, steps {stop_at + 1}-{steps}")
    top.grid(alpha=0.3, which="both")
    top.legend(fontsize=9, loc="lower left")
    bottom.set_yticks(range(len(names)), names)
    bottom.set_ylim(-0.7, len(names) - 0.3)
    bottom.set_ylabel("= 0 exactly", fontsize=9)
    bottom.set_xlabel(STEP_LABEL)
    bottom.grid(alpha=0.3, axis="x")
    bottom.set_xlim(stop_at + 0.5, steps + 0.5)
    return figure


def divergence(rows: dict[str, list[dict]], stop_at: int, steps: int, resumed_distance: float) -> Figure:
    """Max abs and relative L2 weight distance to the reference after every resumed step."""
    figure = Figure(figsize=(9, 4.2), layout="constrained")
    axes = figure.subplots(1, 2)
    measures = (
        ("max_abs_diff", "max |w - w_straight| (weight units)", "largest single-weight difference"),
        ("rel_l2", "||w - w_straight|| / ||w_straight|| (ratio)", "relative L2 distance, all weights"),
    )
    for axis, (key, ylabel, title) in zip(axes, measures):
        for name, log in rows.items():
            axis.plot([r["step"] for r in log], [r[key] for r in log], marker=".", linewidth=1.3, **STYLE[name])
        axis.set_yscale("log")
        axis.set_xlabel(STEP_LABEL)
        axis.set_ylabel(ylabel)
        axis.set_title(title, fontsize=10)
        axis.set_xlim(stop_at, steps + 0.5)
        axis.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8, loc="lower right")
    figure.suptitle(
        f"Weight divergence after resuming at step {stop_at} (resumed: final distance {resumed_distance:g})"
    )
    return figure


def sizes(resume: dict, fp32_bytes: int, fp16_bytes: int) -> Figure:
    """Horizontal bars in MB: the resume file split by part, then the two weights files."""
    figure = Figure(figsize=(8.5, 3.6), layout="constrained")
    axis = figure.subplots()
    segments = (
        ("fp32 weights", resume["weights_bytes"], STYLE["straight"]["color"]),
        ("AdamW moments (exp_avg, exp_avg_sq)", resume["optimizer_moments_bytes"], STYLE["resumed"]["color"]),
        ("the rest (step, generator, RNG, config, names)", resume["rest_bytes"], "0.55"),
    )
    left = 0.0
    for label, nbytes, color in segments:
        axis.barh(2, nbytes / MB, left=left, color=color, label=label, height=0.6)
        if nbytes / resume["file_bytes"] > 0.15:  # room for the number inside the segment
            axis.text(
                left + nbytes / MB / 2, 2, f"{nbytes / MB:.2f} MB", ha="center", va="center", color="white", fontsize=9
            )
        left += nbytes / MB
    axis.barh(1, fp32_bytes / MB, color=STYLE["straight"]["color"], height=0.6)
    axis.barh(0, fp16_bytes / MB, color=STYLE["straight"]["color"], alpha=0.5, height=0.6)
    ends = (
        (2, resume["file_bytes"], f"\n(rest {resume['rest_bytes'] / MB:.3f} MB)"),
        (1, fp32_bytes, ""),
        (0, fp16_bytes, ""),
    )
    for row, nbytes, note in ends:
        axis.annotate(
            f"{nbytes / MB:.2f} MB{note}",
            xy=(nbytes / MB, row),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=9,
        )
    axis.set_yticks([2, 1, 0], ["resume.pth", "straight.pth\n(fp32 weights)", "straight_fp16.pth\n(fp16 weights)"])
    axis.set_xlabel("file size (MB, 10^6 bytes)")
    axis.set_xlim(0, resume["file_bytes"] / MB * 1.2)
    axis.set_title("What the resume file holds, next to the weights files")
    axis.grid(alpha=0.3, axis="x")
    axis.legend(fontsize=8, loc="lower right")
    return figure


def _save(figure: Figure, path: Path) -> Path:
    buffer = io.BytesIO()  # a small PNG: rendered in memory, then written atomically
    figure.savefig(buffer, format="png", dpi=120, metadata={"Software": None})
    atomic_write_bytes(path, buffer.getvalue())
    return path


def write_figures(folder: Path) -> list[Path]:
    """Draw every figure from the lab folder's logs and json files; returns the PNG paths."""
    folder = Path(folder)
    compare = json.loads((folder / "compare.json").read_text())
    fp16 = json.loads((folder / "fp16.json").read_text())
    resume = json.loads((folder / DETAILS / "resume_sizes.json").read_text())
    k, steps = compare["stop_at"], compare["steps"]
    diffs = {name: compare["runs"][name]["loss_diffs"] for name in ("resumed", *ABLATIONS)}
    rows = {name: read_divergence(folder / DETAILS / f"{name}_divergence.csv") for name in ABLATIONS}
    figures = {
        "loss_curves": loss_curves(_loss_logs(folder), k),
        "loss_diff": loss_diff(diffs, k, steps),
        "divergence": divergence(rows, k, steps, compare["runs"]["resumed"]["max_abs_diff"]),
        "sizes": sizes(resume, fp16["fp32_bytes"], fp16["fp16_bytes"]),
    }
    return [_save(figures[name], figure_path(folder, name)) for name in FIGURES]
