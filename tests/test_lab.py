"""`exactresume lab`: every file the lab text names, the figures it asks for, and the report."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from exactresume.core.steplog import read_divergence, read_loss_log
from exactresume.report.captions import caption_values
from exactresume.report.figures import FIGURES
from exactresume.report.report import HEADINGS, render_report
from exactresume.report.tables import render_table
from exactresume.store.weights import read_weights
from exactresume.summaries import lab_summary, render_lab
from helpers import (
    assert_one_line_error,
    call_cli,
    descendants,
    one_torch_thread,
    printed,
    process_state,
    run_cli,
    spawn_cli,
)

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
LAB_FILES = [
    "straight.pth",
    "straight_log.csv",
    "resume.pth",
    "resumed.pth",
    "resumed_log.csv",
    "noopt.pth",
    "noskip.pth",
    "straight_fp16.pth",
    "fp16.json",
    "optim.json",
    "compare.json",
    "report.md",
]


@pytest.fixture(scope="module")
def lab_out(tmp_path_factory, kjv_folder):
    """The lab as the text asks it (60 steps, stop at 30, the default model), on shorter batches than its
    default 8 x 128: 4 x 64 steps cost a quarter, and no file's contract depends on a batch's shape
    (`make lab` and docs/lab/ run the default). Run once per module."""
    out = tmp_path_factory.mktemp("lab")
    with one_torch_thread():  # the lab's own process is this one; its training runs are new processes
        finished = call_cli("lab", "--data", kjv_folder, "--out", out, "--batch", 4, "--seq-len", 64)
    assert finished.returncode == 0, finished.stderr
    (out.parent / "lab_stdout.txt").write_text(finished.stdout)  # beside the lab folder, not in it
    return out


def test_lab_writes_every_named_file_and_no_tmp(lab_out):
    for name in LAB_FILES:
        assert (lab_out / name).stat().st_size > 0, name
    assert not list(lab_out.rglob("*.tmp"))


def test_lab_resumed_equals_straight(lab_out):
    equal = run_cli("diff", lab_out / "straight.pth", lab_out / "resumed.pth")
    assert equal.returncode == 0
    shown = README.split("<!-- diff-output:begin", 1)[1].split("<!-- diff-output:end -->", 1)[0]
    assert shown.split("```text\n", 1)[1].split("```", 1)[0] == equal.stdout  # what the README shows
    assert run_cli("diff", lab_out / "straight.pth", lab_out / "noopt.pth").returncode == 1
    straight_rows = (lab_out / "straight_log.csv").read_text().splitlines()
    resumed_rows = (lab_out / "resumed_log.csv").read_text().splitlines()
    assert straight_rows[0] == resumed_rows[0] == "step,train_loss"
    assert len(straight_rows) == 61 and resumed_rows[1:] == straight_rows[31:]
    assert re.fullmatch(r"31,\d+\.\d{6}", resumed_rows[1])


def test_lab_ablations_diverge(lab_out):
    runs = json.loads((lab_out / "compare.json").read_text())["runs"]
    assert runs["resumed"]["max_abs_diff"] == 0 and runs["resumed"]["log_rows_equal"]
    assert runs["resumed"]["bits_equal"] is True and runs["noopt"]["bits_equal"] is False  # bit for bit
    assert runs["noopt"]["max_abs_diff"] > 1e-3 and runs["noskip"]["max_abs_diff"] > 1e-3
    assert runs["noskip"]["batches_seen_twice"] == 30 and runs["resumed"]["batches_seen_twice"] == 0


# The lab text's grader, with only torch imported: resume.pth is the lab's dict, read by a plain
# torch.load, and the resumed weights equal the straight ones.
GRADER = """
import json, sys
from pathlib import Path
import torch

lab = Path(sys.argv[1])
state = torch.load(lab / "resume.pth", weights_only=True)
missing = [key for key in ("model", "optimizer", "step", "gen_state") if key not in state]
model_numel = sum(t.numel() for name, t in state["model"].items() if name != "lm_head.weight")
optimizer_numel = sum(
    t.numel() for moments in state["optimizer"]["state"].values() for t in moments.values() if t.dim() >= 1
)
straight = torch.load(lab / "straight.pth", weights_only=True)
resumed = torch.load(lab / "resumed.pth", weights_only=True)
print(json.dumps({
    "missing": missing,
    "step": state["step"],
    "gen_state": [str(state["gen_state"].dtype), state["gen_state"].dim()],
    "param_groups": len(state["optimizer"]["param_groups"]),
    "model_numel": model_numel,
    "optimizer_numel": optimizer_numel,
    "ratio": optimizer_numel / model_numel,
    "same_names": straight.keys() == resumed.keys(),
    "max_diff": max((straight[k] - resumed[k]).abs().max().item() for k in straight),
    "equal": all(torch.equal(straight[k], resumed[k]) for k in straight),
    "ours_imported": sorted(name for name in sys.modules if name.startswith("exactresume")),
}))
"""


def test_the_lab_texts_grader_reads_resume_pth_with_a_plain_torch_load(lab_out):
    graded = subprocess.run([sys.executable, "-c", GRADER, lab_out], capture_output=True, text=True, check=True)
    grade = json.loads(graded.stdout)
    assert grade["missing"] == [] and grade["ours_imported"] == []
    assert grade["step"] == 30 and grade["gen_state"] == ["torch.uint8", 1] and grade["param_groups"] == 1
    optim = json.loads((lab_out / "optim.json").read_text())
    assert (grade["model_numel"], grade["optimizer_numel"]) == (optim["model_numel"], optim["optimizer_numel"])
    assert grade["ratio"] == optim["ratio"] == 2.0
    assert grade["same_names"] and grade["equal"] and grade["max_diff"] == 0


def test_half_precision_is_about_half_and_close(lab_out):
    fp16 = json.loads((lab_out / "fp16.json").read_text())
    assert fp16["fp32_bytes"] == (lab_out / "straight.pth").stat().st_size
    assert 0.49 < fp16["fp16_bytes"] / fp16["fp32_bytes"] < 0.52
    assert 0 < fp16["max_logit_diff"] < 0.05
    half = torch.load(lab_out / "straight_fp16.pth", weights_only=True)
    assert all(t.dtype == torch.float16 for t in half.values())
    assert half["lm_head.weight"].data_ptr() == half["model.embed_tokens.weight"].data_ptr()


def test_report_has_headings_and_numbers_from_the_json(lab_out):
    report = (lab_out / "report.md").read_text()
    positions = [report.index(heading) for heading in HEADINGS]
    assert positions == sorted(positions)
    fp16 = json.loads((lab_out / "fp16.json").read_text())
    optim = json.loads((lab_out / "optim.json").read_text())
    noopt = json.loads((lab_out / "compare.json").read_text())["runs"]["noopt"]
    assert f"{fp16['fp16_bytes']:,}" in report and f"{optim['ratio']:.3f}" in report
    assert f"{noopt['max_abs_diff']:.3e}" in report


def numbers_in_every_language(folder) -> list[str]:
    """Numbers the report must show whatever its language, formatted as the report formats them."""
    fp16, optim = json.loads((folder / "fp16.json").read_text()), json.loads((folder / "optim.json").read_text())
    values = caption_values(folder)
    return [
        f"{fp16['fp16_bytes']:,}",
        f"{optim['ratio']:.3f}",
        f"{values['noopt_max_abs_diff']:.3e}",
        f"{values['noskip_rel_l2']:.3e}",
        f"{values['optimizer_moments_bytes']:,}",
        f"{values['rest_bytes']:,}",
        f"{values['noskip_max_loss_diff']:.4f}",
        f"{values['resumed_zero_steps']}",
    ]


@pytest.mark.parametrize("lang", ["ko", "en", "zh"])
def test_report_languages_keep_korean_headings_and_the_numbers(lab_out, lang):
    report = render_report(lab_out, lang)
    positions = [report.index(heading) for heading in HEADINGS]
    assert positions == sorted(positions)
    for number in numbers_in_every_language(lab_out):
        assert number in report, number
    assert all(f"({name}.png)" in report for name in FIGURES)


def test_figures_are_written_and_linked(lab_out):
    report = (lab_out / "report.md").read_text()
    linked = re.findall(r"!\[[^\]]+\]\(([^)]+)\)", report)
    assert sorted(linked) == sorted(f"{name}.png" for name in FIGURES)
    for name in linked:
        data = (lab_out / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000, name


def test_divergence_was_logged_while_training(lab_out):
    compare = json.loads((lab_out / "compare.json").read_text())
    straight_log = read_loss_log(lab_out / "straight_log.csv")
    for name in ("noopt", "noskip"):
        rows = read_divergence(lab_out / "details" / f"{name}_divergence.csv")
        assert [row["step"] for row in rows] == list(range(31, 61))
        # The twin is the uninterrupted run: its losses are straight's log, row for row ...
        assert all(row["reference_loss"] == straight_log[row["step"]] for row in rows)
        # ... and its last distance is the one measured between the final files, to the bit.
        final = compare["runs"][name]
        assert (rows[-1]["max_abs_diff"], rows[-1]["rel_l2"]) == (final["max_abs_diff"], final["rel_l2"])
        assert 0 < rows[0]["max_abs_diff"] < rows[-1]["max_abs_diff"]


def test_lab_progress_is_plain_lines_in_a_pipe(lab_out):
    output = (lab_out.parent / "lab_stdout.txt").read_text()
    assert "\r" not in output
    assert re.search(r"^\[3/8\] resumed: step 60/60 loss \d+\.\d{4} [\d.]+ steps/s$", output, re.MULTILINE)
    assert re.search(r"^\[8/8\] report\.md", output, re.MULTILINE)
    steps = [int(number) for number in re.findall(r"^\[(\d)/8\]", output, re.MULTILINE)]
    assert steps == sorted(steps)  # each run's lines one block, in order, though runs go side by side


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: the lab's runs go one at a time")
def test_the_lab_runs_the_runs_of_a_group_side_by_side(lab_out):
    """Runs 1-2 and 3-5 need nothing of each other: together they took less time than one after another."""
    timings = json.loads((lab_out / "details" / "timings.json").read_text())
    assert timings["total"] < sum(timings[name] for name in ("straight", "stop", "resumed", "noopt", "noskip"))


def test_lab_ends_with_its_summary_read_from_its_files(lab_out):
    output = (lab_out.parent / "lab_stdout.txt").read_text()
    compare = json.loads((lab_out / "compare.json").read_text())
    assert f"resumed = straight: {compare['runs']['resumed']['tensors']} tensors bit-identical" in output
    assert output.endswith("\n\n" + "\n".join(render_lab(lab_summary(lab_out))) + "\n")
    assert f"report             {lab_out / 'report.md'}" in output
    assert "step 8/8" not in output.split("[8/8]")[1]  # no training run's own summary in between


def test_lab_with_other_flags_still_resumes_exactly(tmp_path, kjv_folder):
    flags = ["--seed", 11, "--steps", 9, "--stop-at", 4, "--batch", 3, "--seq-len", 24, "--lr", 1e-3]
    flags += ["--weight-decay", 0.02]  # a field no hand-written flag list of the lab ever passed on
    with one_torch_thread():
        finished = call_cli("lab", "--data", kjv_folder, "--out", tmp_path, *flags, "--json")
    assert finished.returncode == 0, finished.stderr
    assert json.loads(finished.stdout) == lab_summary(tmp_path)  # stdout is the summary alone
    compare = json.loads((tmp_path / "compare.json").read_text())
    assert compare["stop_at"] == 4 and compare["steps"] == 9
    assert compare["runs"]["resumed"]["max_abs_diff"] == 0
    assert len((tmp_path / "resumed_log.csv").read_text().splitlines()) == 1 + 5
    straight, resumed = read_weights(tmp_path / "straight.pth")[0], read_weights(tmp_path / "resumed.pth")[0]
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    state = torch.load(tmp_path / "resume.pth", weights_only=True)
    assert state["step"] == 4 and state["config"]["train"]["seed"] == 11
    assert state["config"]["train"]["weight_decay"] == 0.02


def test_report_carries_the_ablation_table_when_the_lab_ran_one(lab_out, tmp_path):
    for name in ("fp16.json", "optim.json", "compare.json", "resume.pth", "details/resume_sizes.json"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes((lab_out / name).read_bytes())
    assert "| setup |" not in render_report(tmp_path, "en")
    ablation = Path(__file__).resolve().parents[1] / "docs" / "ablation.json"
    (tmp_path / "ablation.json").write_bytes(ablation.read_bytes())
    report = render_report(tmp_path, "en")
    table = "\n".join(render_table(json.loads(ablation.read_text()), "en"))
    assert report.index(HEADINGS[1]) < report.index(table) < report.index(HEADINGS[2])


def test_a_lab_run_again_into_its_folder_remakes_it_and_refuses_files_no_lab_made(tmp_path, kjv_folder):
    earlier = tmp_path / "lab"
    (earlier / "details").mkdir(parents=True)
    (earlier / "details" / "run.json").write_text('{"config": {"stop_at": 5}}')  # an earlier lab's record, and:
    (earlier / "resumed_log.csv").write_text("step,train_loss\n4,1.000000\n9,2.000000\n")  # rows of another run
    (earlier / "ablation.json").write_text("{}")  # a lab run with --ablate; this one is not
    (earlier / "checkpoints").mkdir()  # what an interrupted lab's runs saved as the Ctrl-C reached them
    (earlier / "checkpoints" / "step-00000043.pth").write_bytes(b"a run's preemption checkpoint")
    (earlier / "notes.txt").write_text("the user's own")
    flags = ["--data", kjv_folder, "--steps", 8, "--stop-at", 4, "--preset", "tiny", "--batch", 2, "--seq-len", 16]
    with one_torch_thread():
        finished = call_cli("lab", "--out", earlier, *flags, "--quiet")
    assert finished.returncode == 0, finished.stderr
    runs = json.loads((earlier / "compare.json").read_text())["runs"]
    assert runs["resumed"]["bits_equal"] and runs["resumed"]["log_rows_equal"], runs["resumed"]
    assert not (earlier / "ablation.json").exists() and (earlier / "notes.txt").read_text() == "the user's own"
    assert not (earlier / "checkpoints").exists()
    trained = tmp_path / "trained"  # a training run's folder: its resume.pth is not the lab's to replace
    (trained / "details").mkdir(parents=True)
    (trained / "resume.pth").write_bytes(b"a training run's")
    for record in (None, "{}"):  # no record, or a run.json that is not a lab's
        if record is not None:
            (trained / "details" / "run.json").write_text(record)
        refused = call_cli("lab", "--out", trained, *flags)
        assert_one_line_error(refused, f"{trained} holds resume.pth, details, not an earlier lab's")
        assert (trained / "resume.pth").read_bytes() == b"a training run's"


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_lab_shows_its_progress_as_it_goes_and_ends_its_runs_before_it_returns(
    tmp_path, kjv_folder, stop
):
    out = tmp_path / "lab"
    flags = ["--steps", 4000, "--stop-at", 2000, "--preset", "tiny", "--batch", 2, "--seq-len", 16]
    lab = spawn_cli("lab", "--data", kjv_folder, "--out", out, *flags)
    shown = printed(lab, "[1/8] straight: step 1/4000", timeout=60, stream=0)
    assert "[1/8] straight: step 1/4000" in shown, lab.output()  # shown while its run goes on
    started = descendants(lab.pid)  # its fork server, and the straight and stop runs
    lab.send_signal(stop)
    assert lab.wait(60) == 130 and "exactresume lab: interrupted" in lab.output()[1], lab.output()
    assert [pid for pid in started if process_state(pid) is not None] == []
    time.sleep(0.5)
    assert not (out / "straight.pth").exists() and not (out / "resume.pth").exists()


def test_a_run_the_lab_starts_that_refuses_is_told_in_the_labs_one_line_naming_the_step(tmp_path, kjv_folder):
    finished = run_cli("lab", "--data", kjv_folder, "--out", tmp_path / "lab", env={"EXACTRESUME_FAULT": "nowhere"})
    assert_one_line_error(finished, "exactresume lab: error: lab step straight: EXACTRESUME_FAULT: unknown stage")
    assert "train: error" not in finished.stderr  # the run's own prefix is not repeated inside the lab's


def test_a_lab_refused_at_its_runs_start_keeps_an_earlier_lab_and_leaves_no_folder(lab_out, tmp_path, kjv_folder):
    """What its runs would refuse (memory, a device) is refused before an earlier lab's files are cleared."""
    earlier = tmp_path / "earlier"
    shutil.copytree(lab_out, earlier)
    before = {path: path.read_bytes() for path in earlier.rglob("*") if path.is_file()}
    for flags in (["--batch", 100000], ["--device", "cuda"] if not torch.cuda.is_available() else ["--batch", 10**6]):
        refused = call_cli("lab", "--data", kjv_folder, "--out", earlier, *flags)
        assert_one_line_error(refused)
        assert "--force" not in refused.stderr  # train's advice, which the lab does not take
        assert {path: path.read_bytes() for path in earlier.rglob("*") if path.is_file()} == before
    refused = call_cli("lab", "--data", kjv_folder, "--out", tmp_path / "new" / "lab", "--batch", 100000)
    assert_one_line_error(refused, "needs about")
    assert not (tmp_path / "new").exists()
