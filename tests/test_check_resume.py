"""`exactresume.check_resume`: the doctor as a call. Its verdict is doctor.json's, bad arguments are
refused in one line before any run, and docs/doctor.md's pytest example passes on a script that resumes
exactly and fails, naming the cause, on one that does not."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import exactresume
from exactresume import ResumeCheck, check_resume
from exactresume.errors import MissingExtra, UserError
from helpers import stable_environ

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).parent / "doctor_scripts"
BEGIN, END = "<!-- check-resume-example:begin -->", "<!-- check-resume-example:end -->"


def doc_example() -> str:
    """The pytest example of docs/doctor.md, as the page shows it."""
    block = (ROOT / "docs" / "doctor.md").read_text().split(BEGIN, 1)[1].split(END, 1)[0]
    return block.split("```python\n", 1)[1].split("```", 1)[0]


def beside(folder: Path, script: str) -> Path:
    """The example as a user keeps it: test_train.py next to their train.py (here one of the doctor's scripts)."""
    folder.mkdir(parents=True)
    shutil.copy(SCRIPTS / f"{script}.py", folder / "train.py")
    (folder / "test_train.py").write_text(doc_example())
    return folder / "test_train.py"


def run_example(test_file: Path, tmp_path: Path) -> None:
    """The example's one test called as pytest calls it, in this process: its runs fork from the same
    server as the other doctor tests' (stable_environ), so that each costs a second, not torch's imports."""
    namespace = {"__file__": str(test_file), "__name__": "test_train"}
    exec(compile(test_file.read_text(), "docs/doctor.md", "exec"), namespace)
    with stable_environ():
        namespace["test_training_resumes_exactly"](tmp_path)


def test_the_docs_example_passes_on_a_script_that_resumes_exactly(tmp_path):
    run_example(beside(tmp_path / "user", "correct_handwritten"), tmp_path / "run")
    facts = json.loads((tmp_path / "run" / "doctor" / "doctor.json").read_text())
    assert facts["diagnosis"]["verdict"] == "exact"


def test_the_docs_example_fails_naming_the_cause_on_a_resume_bug(tmp_path):
    with pytest.raises(AssertionError) as failed:
        run_example(beside(tmp_path / "user", "dropout_rng"), tmp_path / "run")
    message = str(failed.value)
    assert message.startswith("doctor: the forward's randomness (dropout) was not restored"), message
    assert "fix: save torch.get_rng_state()" in message
    facts = json.loads((tmp_path / "run" / "doctor" / "doctor.json").read_text())
    assert facts["diagnosis"]["cause"] == "rng_lost"


def test_the_docs_example_runs_under_pytest(tmp_path):
    test_file = beside(tmp_path / "user", "correct_store")
    finished = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(test_file)],
        cwd=test_file.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "1 passed" in finished.stdout


def doctor_on(folder: Path, script: str, **given) -> ResumeCheck:
    command = [sys.executable, str(SCRIPTS / f"{script}.py"), "--out", str(folder / "ckpt")]
    with stable_environ():
        return check_resume(command, **{"steps": 8, "stop_after": 4, "resume_args": "--resume", "warm": True} | given)


def test_the_check_holds_what_doctor_json_holds(tmp_path):
    check = doctor_on(tmp_path, "scheduler_not_saved", out=tmp_path / "doctor")
    diagnosis = json.loads((check.folder / "doctor.json").read_text())["diagnosis"]
    assert check.folder == (tmp_path / "doctor").resolve()
    assert (check.exact, check.verdict, check.cause) == (False, "diverges", "scheduler_lost")
    assert list(check.causes) == diagnosis["causes"] and check.headline == diagnosis["headline"]
    assert (check.first_step, check.resume_step) == (diagnosis["first_step"], diagnosis["resume_step"]) == (6, 4)
    assert list(check.missing) == [row["name"] for row in diagnosis["missing"]] == ["CosineAnnealingLR"]
    assert check.fixes and all(row["fix"] in check.fixes for row in diagnosis["missing"])
    assert str(check) == (check.folder / "verdict.txt").read_text().rstrip("\n")
    assert str(check).startswith(f"doctor: {check.headline}")
    with pytest.raises(dataclasses.FrozenInstanceError):
        check.exact = True


def test_a_command_as_one_string_and_a_folder_of_its_own(tmp_path):
    command = shlex.join([sys.executable, str(SCRIPTS / "correct_store.py"), "--out", str(tmp_path / "ckpt")])
    with stable_environ():
        check = check_resume(command, steps=8, stop_after=4, resume_args=["--resume"], warm=True)
    try:
        assert check.exact and check.cause == "exact", check
        assert check.first_step is None and check.causes == () and check.missing == () and check.fixes == ()
        assert check.folder.parent == Path(tempfile.gettempdir()).resolve()
        assert (check.folder / "doctor.json").exists() and (check.folder / "report.md").exists()
    finally:
        shutil.rmtree(check.folder)


BAD = [
    ({"command": {"python": "train.py"}}, "command must be a list of strings or one string, got a dict"),
    ({"command": ["python", 3]}, "command must be a list of strings"),
    ({"command": []}, "command is empty"),
    ({"command": "python 'train.py"}, "command: No closing quotation"),
    ({"steps": 1}, "steps must be a whole number of at least 2, got 1"),
    ({"steps": 8.0}, "steps must be a whole number"),
    ({"stop_after": 8}, "stop_after must be between 1 and steps - 1 (7), got 8"),
    ({"stop_after": 0}, "stop_after must be between 1 and steps - 1"),
    ({"resume_args": 5}, "resume_args must be a list of strings or one string, got an int"),
    ({"timeout": -1}, "timeout must be a number of seconds above 0"),
    ({"warm": "yes"}, "warm must be True or False"),
    ({"preload": 3}, "preload must be a list of module names, got an int"),
    ({"preload": [1, 2]}, "preload must hold module names (strings), not an int"),
    ({"preload": " , "}, "preload ' , ' names no module"),
    ({"preload": ["transformers", "not a module"]}, "preload: 'not a module' is not a module's name"),
    ({"out": 3}, "out must be a folder's path, got an int"),
]


@pytest.mark.parametrize(("given", "said"), BAD, ids=[next(iter(given)) + str(i) for i, (given, _) in enumerate(BAD)])
def test_bad_arguments_are_refused_in_one_line_before_any_run(tmp_path, given, said):
    arguments = {"command": [sys.executable, "train.py"], "steps": 8, "stop_after": 4, "out": tmp_path / "d"} | given
    with pytest.raises(UserError) as refused:
        check_resume(arguments.pop("command"), **arguments)
    assert said in str(refused.value)
    assert "\n" not in str(refused.value) and str(refused.value).startswith("check_resume: ")
    assert not (tmp_path / "d").exists()  # refused before the doctor's folder is made


def test_out_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "doctor").write_text("mine")
    with pytest.raises(UserError, match="is a file, not a folder"):
        check_resume([sys.executable, "train.py"], steps=8, stop_after=4, out=tmp_path / "doctor")
    assert (tmp_path / "doctor").read_text() == "mine"


def test_what_the_doctor_cannot_judge_is_a_user_error(tmp_path):
    command = [sys.executable, SCRIPTS / "correct_handwritten.py", "--out", tmp_path / "ckpt", "--save-every", "3"]
    with stable_environ(), pytest.raises(UserError) as refused:
        check_resume(command, steps=8, stop_after=7, resume_args="--resume", out=tmp_path / "d", warm=True)
    assert "\n" not in str(refused.value)  # it saves at steps 3 and 6 of 8: nothing at or after 7
    assert "7" in str(refused.value)


def test_without_the_lab_extra_the_call_says_so_before_any_run(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name))
    with pytest.raises(MissingExtra, match=r"pip install 'exactresume\[lab\]'"):
        check_resume([sys.executable, "train.py"], steps=8, stop_after=4, out=tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_the_names_are_public_and_need_the_lab_extra():
    assert exactresume.check_resume is check_resume and exactresume.ResumeCheck is ResumeCheck
    assert {"check_resume", "ResumeCheck"} <= set(exactresume.NEEDS_LAB)
