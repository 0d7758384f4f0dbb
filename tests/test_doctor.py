"""`exactresume doctor` on small real training scripts: every bug named, no false alarm, files put back.

Each script in tests/doctor_scripts/ has its own checkpoint code and one classic resume bug, or
none. The doctor runs each 8 steps, interrupted after its first checkpoint at or after step 4; the
cases run side by side (the doctor mostly waits on its three child processes).
"""

from __future__ import annotations

import json
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from exactresume.cli import main
from exactresume.forkserver.client import forkable
from helpers import SMALL, assert_one_line_error, call_cli, once_per_session, stable_environ

SCRIPTS = Path(__file__).parent / "doctor_scripts"

# script -> (the cause the doctor must name, a phrase its headline must hold)
EXPECTED = {
    "weights_only": ("weights_only", "only the model's weights"),
    "dcp_weights_only": ("weights_only", "only the model's weights (model.dcp)"),
    "fp16_weights": ("weights_rounded", "stored in float16"),
    "fresh_optimizer": ("optimizer_lost", "fresh optimizer"),
    # the same, where the lost optimizer's lr (its param_groups') differs first: named as the optimizer's
    "fresh_optimizer_lr": ("optimizer_lost", "fresh optimizer: moments and step counter start from zero); its lr is"),
    "scheduler_not_saved": ("scheduler_lost", "CosineAnnealingLR"),
    "shuffle_generator": ("data_position_lost", "generator state is not in the checkpoint"),
    "dropout_rng": ("rng_lost", "dropout"),
    "epoch_not_saved": ("epoch_lost", "set_epoch(0)"),
    "scaler_not_saved": ("scaler_lost", "GradScaler"),
    "accumulation_window": ("accumulation_window", "gradient-accumulation window"),
    "lr_from_zero": ("lr_from_zero", "restarts at 0"),
    "weights_file_resume": ("weights_file", "rather than from resume.pt"),
    "unseeded_init": ("not_deterministic", "initialization is not seeded"),
    "correct_handwritten": ("exact", "bit-identical"),
    "correct_store": ("exact", "bit-identical"),
    "exactresume_train": ("exact", "bit-identical"),
}


def doctor_args(
    folder: Path, script: str, *extra: str, resume: str = "--resume", stop_after: int = 4, warm: bool = True
) -> list[str]:
    """The doctor on a script; `warm`: its runs forked from one process that imported torch (--warm)."""
    command = [sys.executable, str(SCRIPTS / f"{script}.py"), "--out", str(folder / "ckpt"), *extra]
    flags = ["--steps", "8", "--stop-after", str(stop_after), "--out", str(folder / "doctor")]
    flags += ["--warm"] if warm else []
    return ["doctor", *flags, *([f"--resume-args={resume}"] if resume else []), "--", *command]


def train_args(folder: Path, data: Path) -> list[str]:
    """`exactresume train` itself as the doctor's subject, resumed with --resume auto."""
    train = ["train", "--data", str(data), "--out", str(folder / "run"), "--save-every", "2", "--keep", "0"]
    command = [sys.executable, "-m", "exactresume.cli", *train, *SMALL]
    flags = ["--steps", "8", "--stop-after", "4", "--out", str(folder / "doctor"), "--resume-args=--resume auto"]
    return ["doctor", "--warm", *flags, "--", *command]


# A case of its own: a script and its flags.
VARIANTS = {"fresh_optimizer_lr": ("fresh_optimizer", "--lr-as-built")}

# Run as the user runs it, each run a cold process; the other cases fork their runs (--warm), and
# unseeded_init among them finds the forks' fresh seeds as new processes have them. test_doctor_frameworks.py
# runs a correct script (the Trainer's) cold.
COLD = ("dropout_rng",)
TWICE = "dropout_rng"  # also run --warm: the same diagnosis either way


@pytest.fixture(scope="session")
def doctored(tmp_path_factory, tiny_folder) -> dict[str, tuple]:
    """Every script through the doctor once: script -> (exit code, stdout, doctor.json, its folder)."""

    def run(root: Path, case: str):
        (script, *extra), folder = VARIANTS.get(case, (case.removesuffix("@warm"),)), root / case
        if script == "exactresume_train":
            args = train_args(folder, tiny_folder)
        else:
            args = doctor_args(folder, script, *extra, warm=case not in COLD)
        code = main(args)  # threads share sys.stdout: read what it printed from verdict.txt
        facts = json.loads((folder / "doctor" / "doctor.json").read_text())
        return case, [code, (folder / "doctor" / "verdict.txt").read_text(), facts, str(folder)]

    def every_case(root: Path) -> dict:
        with ThreadPoolExecutor(4) as pool:
            return dict(pool.map(lambda case: run(root, case), [*EXPECTED, f"{TWICE}@warm"]))

    with stable_environ():
        cases = once_per_session(tmp_path_factory, "doctored", every_case)
    return {script: (code, text, facts, Path(folder)) for script, (code, text, facts, folder) in cases.items()}


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_the_doctor_names_the_cause(doctored, script):
    code, stdout, facts, _ = doctored[script]
    cause, phrase = EXPECTED[script]
    diagnosis = facts["diagnosis"]
    assert diagnosis["cause"] == cause, diagnosis["headline"]
    assert phrase in diagnosis["headline"]
    assert code == (0 if cause == "exact" else 1)  # a run that is not deterministic also exits 1
    assert stdout.startswith(f"doctor: {diagnosis['headline']}")
    if cause == "exact":
        assert diagnosis["missing"] == [] and diagnosis["first_step"] is None


def test_forked_runs_give_the_diagnosis_cold_runs_give(doctored):
    cold, warm = doctored[TWICE][2], doctored[f"{TWICE}@warm"][2]
    assert warm["diagnosis"] == cold["diagnosis"]
    servers = {run["forked_from"] for run in warm["runs"].values()}
    assert len(servers) == 1 and isinstance(next(iter(servers)), int)  # each warm run forked, from one server
    assert {run["forked_from"] for run in cold["runs"].values()} == {None}
    pids = {rank["pid"] for run in warm["runs"].values() for rank in run["ranks"].values()}
    assert len(pids) == 3 and not pids & servers  # three new processes, none of them the server


def test_warm_forks_python_scripts_and_modules_only():
    python = sys.executable
    assert forkable([python, "train.py", "--out", "x"]) == {"argv": ["train.py", "--out", "x"]}
    assert forkable(["python3.11", "-m", "pkg.train", "-v"]) == {"module": "pkg.train", "argv": ["pkg.train", "-v"]}
    cold = (["torchrun", "train.py"], [python, "-u", "train.py"], [python, "-c", "pass"], ["exactresume", "train"])
    for command in cold:
        assert forkable(command) is None, command


def test_the_missing_state_is_listed_with_a_fix(doctored):
    missing = {s: {m["kind"] for m in doctored[s][2]["diagnosis"]["missing"]} for s in EXPECTED}
    assert missing["fresh_optimizer"] == {"optimizer"}
    assert missing["scheduler_not_saved"] == {"lr_scheduler"}
    assert missing["scaler_not_saved"] == {"grad_scaler"}
    assert missing["dropout_rng"] == {"global_rng"}
    assert {"optimizer", "lr_scheduler"} <= missing["weights_only"]
    assert "CheckpointStore" in doctored["fresh_optimizer"][2]["diagnosis"]["missing"][0]["fix"]


def test_files_are_put_back_and_the_report_is_written(doctored):
    _, stdout, facts, folder = doctored["correct_handwritten"]
    straight = folder / "doctor" / "files" / "resumed" / "000-ckpt" / "resume.pt"  # the folder the run made
    assert (folder / "ckpt" / "resume.pt").is_file() and straight.is_file()
    assert not (folder / "doctor" / "files" / "moved.json").exists()
    assert str(folder / "ckpt") in stdout
    report = (folder / "doctor" / "report.md").read_text()
    assert "bit-identical" in report and (folder / "doctor" / "doctor.png").stat().st_size > 1000
    assert all(facts["diagnosis"]["equal"]["params"]) and facts["diagnosis"]["distance"] == [0.0] * 8


def test_the_first_differing_step_is_named(doctored):
    firsts = {s: doctored[s][2]["diagnosis"]["first_step"] for s in doctored}
    assert firsts["scheduler_not_saved"] == 6  # the restored lr is right once, then the new scheduler steps
    assert firsts["epoch_not_saved"] == 7 and firsts["shuffle_generator"] == 7  # the checkpoint of step 6
    assert firsts["fp16_weights"] == 5
    batch = doctored["weights_only"][2]["diagnosis"]["evidence"]
    assert any("restarted from the first batch" in line for line in batch)


def test_usage_errors(tmp_path):
    assert_one_line_error(call_cli("doctor", "--steps", "8", "--stop-after", "4", "--out", tmp_path), "command")
    assert_one_line_error(
        call_cli("doctor", "--steps", "8", "--stop-after", "8", "--out", tmp_path, "--", "python"),
        "--stop-after must be between 1 and --steps - 1 (7), got 8",
    )
    out = tmp_path / "never-made"
    finished = call_cli("doctor", "--steps", "1", "--stop-after", "1", "--out", out, "--", "python")
    assert_one_line_error(finished, "--steps must be a whole number of at least 2, got 1")
    assert not out.exists()  # refused before the doctor makes its folder
    (tmp_path / "a-file").write_text("")
    finished = call_cli(
        "doctor", "--steps", "8", "--stop-after", "4", "--out", tmp_path / "a-file" / "d", "--", "python"
    )
    assert_one_line_error(finished, "cannot create output folder", "Not a directory")
    finished = call_cli("doctor", "--steps", "8", "--stop-after", "4", "--bogus", "--out", tmp_path, "--", "python")
    assert_one_line_error(finished, "exactresume doctor: error: unrecognized arguments: --bogus")


def test_a_failing_command_shows_its_last_line(tmp_path):
    command = ["--", sys.executable, "-c", "print('loading'); raise SystemExit('no such dataset')"]
    finished = call_cli("doctor", "--steps", "8", "--stop-after", "4", "--out", tmp_path / "d", *command)
    assert_one_line_error(finished, "exit code 1", "no such dataset")


def test_a_script_without_optimizer_steps_is_refused(tmp_path):
    command = ["--", sys.executable, "-c", "print('hello')"]
    finished = call_cli("doctor", "--steps", "8", "--stop-after", "4", "--out", tmp_path / "d", *command)
    assert_one_line_error(finished, "no optimizer step")


def test_a_short_straight_run_is_refused(tmp_path):
    finished = call_cli(*doctor_args(tmp_path, "correct_handwritten", "--steps", "3"))
    assert_one_line_error(finished, "after 3 optimizer steps", "--steps 8")


def test_a_script_that_never_saves_after_stop_after(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "resume.pt").write_bytes(b"the user's own file")
    finished = call_cli(*doctor_args(tmp_path, "correct_handwritten", "--save-every", "3", stop_after=7))
    assert_one_line_error(finished, "--stop-after 7", "saved at steps 3, 6")
    # the straight run replaced a file that was there before: that file is back, the run's is kept aside
    assert (tmp_path / "ckpt" / "resume.pt").read_bytes() == b"the user's own file"
    assert (tmp_path / "doctor" / "files" / "straight" / "000-resume.pt").stat().st_size > 1000


def test_ignored_resume_arguments_are_named(tmp_path):
    finished = call_cli(*doctor_args(tmp_path, "correct_handwritten", resume=""))
    assert_one_line_error(finished, "started at step 0", "no --resume-args")


def test_a_straight_run_that_loads_a_checkpoint_was_not_fresh(doctored, tmp_path):
    (tmp_path / "ckpt").mkdir()
    shutil.copy(doctored["correct_handwritten"][3] / "ckpt" / "resume.pt", tmp_path / "ckpt" / "resume.pt")
    finished = call_cli(*doctor_args(tmp_path, "correct_handwritten", "--resume", resume=""))
    assert_one_line_error(finished, "not fresh", str(tmp_path / "ckpt" / "resume.pt"))
