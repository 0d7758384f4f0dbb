"""docs/object-store.md: its measured figures are what bench/object_store.py renders from the committed json."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_object_store_figures_are_rendered_from_docs_json():
    from bench.object_store import BEGIN, END, render

    figures = json.loads((ROOT / "docs" / "object_store.json").read_text())
    page = (ROOT / "docs" / "object-store.md").read_text()
    assert page.split(BEGIN, 1)[1].split(END, 1)[0] == "\n" + render(figures)
    for name in ("save", "load", "async"):  # each figure beside its goal, and whether it was met
        sign, goal = figures[name]["goal"].split()
        met = figures[name]["ratio"] <= float(goal) if sign == "<=" else figures[name]["ratio"] >= float(goal)
        assert figures[name]["met"] == met, name
    assert figures["save"]["candidate_mb_per_s"] == figures["bytes"] / 1e6 / figures["save"]["candidate_s"]["median"]
