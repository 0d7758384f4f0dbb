"""docs/loaders.md: each recipe runs as a user's script, and runs again, resuming from what it saved."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import run_python

PAGE = Path(__file__).parent.parent / "docs" / "loaders.md"
# A recipe is the python block right after a `<!-- loaders-recipe -->` line; other blocks are prose.
RECIPE = re.compile(r"<!-- loaders-recipe -->\n```python\n(.*?)```", re.DOTALL)
RECIPES = RECIPE.findall(PAGE.read_text())


def test_the_page_has_a_recipe_per_loader():
    """Plain DataLoader, with workers, DistributedSampler, StatefulDataLoader (and any section added later)."""
    assert len(RECIPES) >= 4
    for needle in ("shuffle=True)", "num_workers=2", "DistributedSampler(dataset", "StatefulDataLoader(dataset"):
        assert any(needle in recipe for recipe in RECIPES), needle


@pytest.mark.parametrize("recipe", RECIPES, ids=[f"recipe-{number}" for number in range(1, len(RECIPES) + 1)])
def test_a_recipe_runs_and_runs_again(recipe, tmp_path):
    script = tmp_path / "recipe.py"
    # Its checkpoints folder is relative, as a user's: the script runs in a folder of its own.
    script.write_text(f"import os\nos.chdir({str(tmp_path)!r})\n" + recipe)
    for run in ("first", "again"):
        finished = run_python(script, preload=("datasets",) if "datasets" in recipe else ())
        assert finished.returncode == 0, f"{run}: {finished.stdout}"
