"""Causes after the batch and the weights: what the forward read that the resume did not restore (a frozen
or averaged copy of the model, a model's buffers), where its optimizer state landed (loaded by position
onto parameters its param groups list in another order), and buffers that part while every step agrees.

The order a step computes is batch, weights, forward, gradients, optimizer state: when the gradients part
with the same batch, weights and lr, the optimizer state cannot be the cause, whatever else parts later.
"""

from __future__ import annotations

from exactresume.doctor.context import Context, later
from exactresume.errors import listed

EARLIER = ("batch", "params", "lr", "hparams", "layout")


def forward_state(c: Context):
    if "grads" not in c.diff or set(EARLIER) & set(c.diff):
        return None
    evidence = ["same batch, weights and lr, other gradients"]
    if "buffers" in c.diff:
        evidence.append(f"the model's buffers differ at step {c.step}")
    modules, buffers = c.unsaved("forward_module"), [r for r in c.unsaved("model") if r.get("buffers")]
    if modules:
        names = listed([r["name"] for r in modules])
        headline = (
            f"{later(c)}the forward reads a module the checkpoint does not hold: {names} runs in the forward without "
            "training (a frozen or averaged copy of the model, such as an EMA) and is not in the file, so the resumed "
            "run's copy differs"
        )
        return "forward_module_lost", headline, evidence + [f"{r['name']}: {r['detail']}" for r in modules]
    if buffers:
        return "buffers_lost", _buffers_headline(c, buffers, "the forward reads them: "), evidence
    headline = (
        f"{later(c)}the same batch, weights and lr give other gradients: the forward reads state the resume did not "
        "restore (a module or buffer outside the file, or a value the script computes)"
    )
    return "forward_state", headline, evidence


def _buffers_headline(c: Context, rows: list[dict], reads: str) -> str:
    row = max(rows, key=lambda r: len(r["buffers"]))
    shown = ", ".join(row["buffers"][:4]) + (" ..." if len(row["buffers"]) > 4 else "")
    kind = " (running statistics)" if any("running_" in name for name in row["buffers"]) else ""
    return f"{later(c)}{reads}{row['name']}'s buffers{kind} are not in the checkpoint: {shown}"


def buffers_only(c: Context):
    """Every step agrees but the trained model's buffers (not the optimizer's parameters) part: the resumed
    model holds other running statistics, which an evaluation reads."""
    if "buffers" not in c.diff or set(c.diff) - {"buffers", "data", "rng_torch", "rng_cuda", "rng_numpy"}:
        return None
    rows = [r for r in c.unsaved("model") if r.get("buffers")]
    evidence = [f"the steps compared are bit-identical; the model's buffers differ from step {c.step}"]
    if not rows:
        headline = f"the model's buffers differ from step {c.step} on: the resume did not restore them"
        return "buffers_lost", headline, evidence
    headline = _buffers_headline(c, rows, "")
    headline += ", so the resumed model's buffers differ (the steps agree, an evaluation would not)"
    return "buffers_lost", headline, evidence


def optimizer_order(c: Context):
    """The resumed optimizer lists the same parameters in other groups or another order: its state_dict(),
    loaded by position, lands on other parameters."""
    if "layout" not in c.diff or not {"optim", "params", "grads", "lr", "hparams"} & set(c.diff):
        return None
    a, b = groups(c.runs.straight, c.straight.get("layout")), groups(c.runs.resumed, c.resumed.get("layout"))
    evidence = []
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            evidence.append(f"param group {index} holds {few(y)} in the resumed run, {few(x)} in the straight one")
            break
    headline = (
        f"{later(c)}the optimizer state was loaded onto other parameters: the resumed optimizer lists its "
        "parameters in other param groups or another order, and load_state_dict() maps the saved state by position"
    )
    return "optimizer_misplaced", headline, evidence


def groups(run, layout) -> list[list[str]]:
    found = [e for p in run.processes for e in p.events if e["event"] == "layout" and e["layout"] == layout]
    return found[0]["groups"] if found else []


def few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
