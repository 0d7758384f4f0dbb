"""Captions say only what their numbers show: rendered from the committed lab json and from made-up ones.

A caption may say `resumed` "lies exactly on `straight`" only when the loss difference is 0, that
its final distance cannot be drawn on a log axis only when it is 0, and that `noopt` is 0 at the
first resumed step only when it is. The made-up compare.json below describes a resume that went wrong.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from exactresume.report.captions import PHRASES, figure_block
from exactresume.report.report import render_report

DOCS_LAB = Path(__file__).resolve().parents[1] / "docs" / "lab"
LANGS = ("ko", "en", "zh")
DATA_DEPENDENT = ("on_straight", "end_zero", "noopt_zero_first")


def lab_folder(tmp_path: Path, edit=None) -> Path:
    """The json files the captions read, copied from docs/lab; `edit(compare)` changes compare.json."""
    folder = tmp_path / "lab"
    (folder / "details").mkdir(parents=True)
    for name in ("compare.json", "fp16.json", "optim.json", "details/resume_sizes.json"):
        shutil.copy(DOCS_LAB / name, folder / name)
    (folder / "resume.pth").write_bytes(bytes(1000))  # the report states its size only
    if edit is not None:
        compare = json.loads((folder / "compare.json").read_text())
        edit(compare)
        (folder / "compare.json").write_text(json.dumps(compare))
    return folder


def captions(folder: Path, lang: str) -> str:
    return "\n".join(
        line for name in ("loss_curves", "loss_diff", "divergence") for line in figure_block(folder, name, lang)
    )


ALTERNATIVE = {"on_straight": "off_straight", "end_zero": "end_other", "noopt_zero_first": "noopt_zero_other"}


def the_sentence(lang: str, key: str) -> str:
    """The longest literal piece of a data-dependent sentence that its alternative does not share."""
    pieces = re.split(r"\{[^}]*\}", PHRASES[lang][key])
    alternative = PHRASES[lang].get(ALTERNATIVE.get(key, ""), "")
    return max((piece for piece in pieces if piece.strip() and piece not in alternative), key=len)


def diverged(compare: dict) -> None:
    """A resume that went wrong: resumed off straight by 1e-3 in the loss and 2.5e-4 in the weights."""
    resumed, noopt = compare["runs"]["resumed"], compare["runs"]["noopt"]
    for row in resumed["loss_diffs"][1:]:
        row["diff"] = 1e-3
    resumed |= {"max_abs_diff": 2.5e-4, "rel_l2": 1e-5, "max_abs_loss_diff": 1e-3, "log_rows_equal": False}
    resumed["bits_equal"] = False
    for row in noopt["loss_diffs"]:
        row["diff"] = row["diff"] or 5e-4  # noopt never 0


@pytest.mark.parametrize("lang", LANGS)
def test_the_committed_lab_gets_the_exact_sentences(tmp_path, lang):
    text = captions(lab_folder(tmp_path), lang)
    for key in DATA_DEPENDENT:
        assert the_sentence(lang, key) in text, key


@pytest.mark.parametrize("lang", LANGS)
def test_a_divergent_compare_json_gets_no_exact_sentence(tmp_path, lang):
    text = captions(lab_folder(tmp_path, diverged), lang)
    for key in DATA_DEPENDENT:
        assert the_sentence(lang, key) not in text, key
    assert "1.000e-03" in text and "2.500e-04" in text  # the differences are said, with their size
    assert the_sentence(lang, "noopt_zero_none") in text
    if lang == "en":
        assert "lies exactly" not in text and "cannot draw" not in text


def test_noopt_zero_at_a_later_step_is_not_called_the_first_resumed_step(tmp_path):
    def later(compare):
        rows = compare["runs"]["noopt"]["loss_diffs"]
        rows[0]["diff"], rows[3]["diff"] = 1e-4, 0.0

    text = captions(lab_folder(tmp_path, later), "en")
    assert "`noopt` is 0 at steps 34." in text and "the first resumed step" not in text


def test_the_report_says_bit_identical_only_when_the_bits_are(tmp_path):
    assert "is bit for bit identical to the uninterrupted" in render_report(lab_folder(tmp_path), "en")


def test_the_report_of_a_divergent_lab_says_how_far_it_is(tmp_path):
    report = render_report(lab_folder(tmp_path, diverged), "en")
    assert "bit for bit" not in report and "lies exactly" not in report
    assert "differs from the uninterrupted `straight.pth` by at most **0.00025** in any tensor" in report
    assert "are not identical as text" in report


def test_the_report_does_not_say_a_part_left_out_changed_the_weights_when_it_did_not(tmp_path):
    def nothing_changed(compare):
        for name in ("noopt", "noskip"):
            compare["runs"][name]["max_abs_diff"] = 0.0

    report = render_report(lab_folder(tmp_path, nothing_changed), "en")
    assert "changed no weight here" in report and "changes the result without any error" not in report
