"""`exactresume ablate`: every part measured, only the reference rows at zero, the data counts read
from the samples logs, the same json from the same command, and the table in docs/resume-file.md rendered from
docs/ablation.json. (The lab report's copy of the table is tested in test_lab.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exactresume.config import TrainConfig
from exactresume.core.steplog import read_samples
from exactresume.lab.ablate import VARIANTS
from exactresume.report.tables import readme_block, render_markdown
from exactresume.summaries import number
from helpers import SMALL, assert_one_line_error, call_cli

ROOT = Path(__file__).resolve().parents[1]
PAGE, DOCS_JSON = ROOT / "docs" / "resume-file.md", ROOT / "docs" / "ablation.json"  # the page holding the table
ABLATE_FLAGS = [*SMALL, "--stop-at", "4"]  # 4 resumed steps of 2 sequences
METRICS = (
    "max_abs_diff",
    "rel_l2",
    "first_loss_diff",
    "final_loss_diff",
    "val_loss_diff",
    "samples_seen_twice",
    "samples_never_seen",
)
DATA_ROWS = {("base", "noskip"), ("epoch", "nocursor")}


@pytest.fixture(scope="module")
def ablation_folder(tmp_path_factory, kjv_folder):
    """A small ablation, run once for the module."""
    out = tmp_path_factory.mktemp("ablate")
    finished = call_cli("ablate", "--data", kjv_folder, "--out", out, *ABLATE_FLAGS)
    assert finished.returncode == 0, finished.stderr
    (out.parent / f"{out.name}_stdout.txt").write_text(finished.stdout)  # beside the folder, not in it
    return out


@pytest.fixture(scope="module")
def rows(ablation_folder) -> dict[tuple[str, str], dict]:
    ablation = json.loads((ablation_folder / "ablation.json").read_text())
    return {(row["setup"], row["name"]): row for row in ablation["rows"]}


def test_every_part_is_measured_and_only_the_reference_rows_are_zero(rows):
    assert set(rows) == {(variant.setup, variant.name) for variant in VARIANTS}
    for (setup, name), row in rows.items():
        if name == "exact":
            assert all(row[metric] == 0 for metric in METRICS), setup
        else:
            assert row["max_abs_diff"] > 0 and row["rel_l2"] > 0 and row["val_loss_diff"] != 0, name


def test_the_first_resumed_loss_moves_only_with_the_batch_the_mask_or_the_weights(rows):
    moved = {key for key, row in rows.items() if row["first_loss_diff"] != 0}
    assert moved == DATA_ROWS | {("base", "fp16_weights"), ("base", "bf16_weights"), ("dropout", "norng")}


def test_lost_data_positions_are_counted_from_the_samples_logs(ablation_folder, rows):
    for key, row in rows.items():
        expected = 4 * 2 if key in DATA_ROWS else 0
        assert row["samples_seen_twice"] == row["samples_never_seen"] == expected, key
    for setup, name in DATA_ROWS:  # both replay the first steps' samples
        straight = read_samples(ablation_folder / "ablation" / setup / "straight_samples.csv")
        replayed = read_samples(ablation_folder / "ablation" / setup / f"{name}_samples.csv")
        assert [replayed[step] for step in range(5, 9)] == [straight[step] for step in range(1, 5)]


def test_the_same_command_writes_the_same_json_and_table(tmp_path, kjv_folder, ablation_folder):
    assert call_cli("ablate", "--data", kjv_folder, "--out", tmp_path, *ABLATE_FLAGS).returncode == 0
    for name in ("ablation.json", "ablation.md"):
        assert (tmp_path / name).read_bytes() == (ablation_folder / name).read_bytes()


def test_the_table_is_rendered_from_docs_ablation_json_of_the_default_run():
    ablation = json.loads(DOCS_JSON.read_text())
    assert readme_block(PAGE.read_text()) == render_markdown(ablation)
    assert ablation["setups"]["base"] == TrainConfig().to_dict() and ablation["stop_at"] == 30


def test_markdown_rewrites_only_the_pages_block(tmp_path):
    original = PAGE.read_text()
    copy = tmp_path / "README.md"
    copy.write_text(original.replace(readme_block(original), "a stale table"))
    assert call_cli("ablate", "--markdown", DOCS_JSON, "--readme", copy).returncode == 0
    assert copy.read_text() == original


def test_ablate_without_out_or_markdown_is_a_one_line_error(tmp_path):
    assert_one_line_error(call_cli("ablate"), "--out")
    (tmp_path / "other.json").write_text('{"rows": []}')
    assert_one_line_error(call_cli("ablate", "--markdown", tmp_path / "other.json"), "not an ablation.json")


def test_ablate_ends_with_a_summary_of_ablation_json(ablation_folder, rows):
    output = (ablation_folder.parent / f"{ablation_folder.name}_stdout.txt").read_text()
    summary = output.split("\n\n", 1)[1]
    for (setup, name), row in rows.items():
        line = next(line for line in summary.splitlines() if line.startswith(f"{setup}/{name} "))
        assert number(row["max_abs_diff"]) in line.split() and f"{row['samples_seen_twice']}/" in line
    assert (
        f"{ablation_folder / 'ablation.json'}  ({(ablation_folder / 'ablation.json').stat().st_size:,} bytes)"
        in summary
    )
