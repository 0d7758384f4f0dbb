"""`exactresume doctor` on a command whose Python is not the doctor's, and on a tracer that fails.

The doctor runs from this environment; the command's Python may have torch and nothing else (no
numpy, no xxhash, no exactresume), may lack torch, or may not be a Python at all. The tracer inside it
must never change what the script does, even when its own hooks fail, and must follow a DataLoader
over an IterableDataset. The doctor's cases run side by side (it mostly waits on its child processes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from packaging.requirements import Requirement

from exactresume.cli import main
from exactresume.doctor.session import one_hash
from exactresume.doctor.tracer.guard import SIGHT
from exactresume.errors import UserError
from helpers import assert_one_line_error, call_cli, run_python, stable_environ

SCRIPTS = Path(__file__).parent / "doctor_scripts"
FLAGS = ["--steps", "8", "--stop-after", "4", "--resume-args=--resume"]
RUNS = ("straight", "interrupted", "resumed")


def runtime_closure(name: str) -> set[str]:
    """The distribution `name` and every one it needs at run time (no extras), as installed here."""
    found, pending = set(), [name]
    while pending:
        current = metadata.distribution(pending.pop())
        key = current.metadata["Name"].lower()
        if key in found:
            continue
        found.add(key)
        for line in current.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return found


def make_python(root: Path, distributions: set[str]) -> Path:
    """A venv without pip whose site-packages links `distributions`' files from this environment's."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = root / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    here = Path(sysconfig.get_paths()["purelib"])
    for name in distributions:
        tops = {Path(str(f)).parts[0] for f in metadata.distribution(name).files or []}
        for top in tops - {"..", "__pycache__"}:
            if (here / top).exists() and not top.endswith(".pth") and not (site / top).exists():
                (site / top).symlink_to(here / top)
    return root / "bin" / "python"


@pytest.fixture(scope="module")
def pythons(tmp_path_factory) -> dict[str, Path]:
    """`torch`: a Python with torch and its runtime dependencies only; `bare`: one without torch."""
    needed = runtime_closure("torch")
    assert not needed & {"numpy", "xxhash", "exactresume"}, needed
    root = tmp_path_factory.mktemp("pythons")
    return {"torch": make_python(root / "torch", needed), "bare": make_python(root / "bare", set())}


def doctor(folder: Path, command: list[str], warm: bool = True) -> dict:
    """The doctor on `command` (its --out under `folder`): exit code, verdict, doctor.json."""
    code = main(["doctor", *FLAGS, "--out", str(folder / "doctor"), *(["--warm"] if warm else []), "--", *command])
    facts = json.loads((folder / "doctor" / "doctor.json").read_text())
    return {"code": code, "verdict": (folder / "doctor" / "verdict.txt").read_text(), "facts": facts}


def by_hand(folder: Path, *extra: str) -> dict:
    """The stream script straight, then its checkpoint of step 4 resumed in a folder of its own, outside the
    doctor: which straight step each resumed batch is, and whether the final weights are equal."""
    script, straight, resumed = SCRIPTS / "iterable_stream.py", folder / "straight", folder / "resumed"
    assert run_python(script, "--out", straight, "--record", folder / "a", *extra).returncode == 0
    resumed.mkdir()
    shutil.copyfile(straight / "resume.pt.4", resumed / "resume.pt")
    assert run_python(script, "--out", resumed, "--resume", "--record", folder / "b", *extra).returncode == 0
    a, b = torch.load(folder / "a"), torch.load(folder / "b")
    drew = [next((i + 1 for i, x in enumerate(a["batches"]) if torch.equal(x, y)), None) for y in b["batches"]]
    same = all(torch.equal(a["weights"][name], b["weights"][name]) for name in a["weights"])
    return {"drew_step": drew, "weights_equal": same}


@pytest.fixture(scope="module")
def cases(pythons, tmp_path_factory) -> dict[str, dict]:
    """Every doctor case once, side by side: name -> its result."""
    root = tmp_path_factory.mktemp("any_python")
    stream, dropout = [sys.executable, str(SCRIPTS / "iterable_stream.py")], SCRIPTS / "dropout_rng.py"
    # `env` (not a Python) starts the script: the tracer still starts in the Python it runs, cold
    failing = ["env", "EXACTRESUME_DOCTOR_FAIL_FROM=6", sys.executable, str(SCRIPTS / "every_hook.py")]
    jobs = {
        # cold: each run starts the tracer through its sitecustomize, as a user's command does
        "torch_only": lambda f: doctor(f, [str(pythons["torch"]), str(dropout), "--out", str(f / "c")], warm=False),
        "stream": lambda f: doctor(f, [*stream, "--out", str(f / "ckpt")]),
        "stream_none": lambda f: doctor(f, [*stream, "--out", str(f / "ckpt"), "--batch-none"]),
        "stream_by_hand": lambda f: by_hand(f),
        "stream_none_by_hand": lambda f: by_hand(f, "--batch-none"),
        "failing_hooks": lambda f: doctor(f, [*failing, "--out", str(f / "ckpt")]),
    }

    def run(name: str):
        (root / name).mkdir()
        return name, jobs[name](root / name) | {"folder": str(root / name)}

    with stable_environ(), ThreadPoolExecutor(3) as pool:
        return dict(pool.map(run, jobs))


def test_a_python_with_torch_and_nothing_else_gets_the_same_verdict(cases, pythons):
    found = subprocess.run(
        [
            pythons["torch"],
            "-c",
            "import importlib.util as u; print([m for m in ('numpy', 'xxhash', 'exactresume') if u.find_spec(m)])",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout.strip() == "[]"
    case = cases["torch_only"]
    diagnosis = case["facts"]["diagnosis"]
    assert case["code"] == 1 and diagnosis["cause"] == "rng_lost" and "dropout" in diagnosis["headline"]
    assert [m["kind"] for m in diagnosis["missing"]] == ["global_rng"]
    traces = Path(case["folder"]) / "doctor" / "traces"
    events = [json.loads(line) for trace in traces.glob("*/trace-*.jsonl") for line in trace.read_text().splitlines()]
    assert {e["hash"] for e in events if e["event"] == "start"} == {"blake2b-64"}  # no xxhash: the standard library's
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == 8 + 4 + 4 and not any("rng_numpy" in step for step in steps)  # numpy never loaded


@pytest.mark.parametrize("warm", [False, True])
def test_a_python_without_torch_is_named_in_one_line(pythons, tmp_path, warm):
    command = [pythons["bare"], SCRIPTS / "dropout_rng.py", "--out", tmp_path / "ckpt"]
    flags = [*FLAGS, "--out", tmp_path / "doctor", *(["--warm"] if warm else [])]
    finished = call_cli("doctor", *flags, "--", *command)
    assert_one_line_error(finished, f"the tracer could not start in {pythons['bare']}: No module named 'torch'")
    assert "no optimizer step" not in finished.stderr
    assert not (tmp_path / "ckpt").exists()  # the script never ran untraced
    log = (tmp_path / "doctor" / "logs" / "straight.log").read_text()
    assert "the tracer could not start" in log


def test_a_command_that_is_not_a_python_program_is_named_in_one_line(tmp_path):
    finished = call_cli("doctor", *FLAGS, "--out", tmp_path / "doctor", "--", "/bin/echo", "hi")
    assert_one_line_error(finished, "/bin/echo is not a Python program")


def test_the_script_does_what_it_does_when_every_hook_fails(tmp_path):
    plain = run_python(SCRIPTS / "every_hook.py", "--out", tmp_path / "plain", "--exit-code", "3")
    env = {"EXACTRESUME_DOCTOR_TRACE": str(tmp_path / "trace"), "EXACTRESUME_DOCTOR_FAIL_FROM": "1"}
    traced = run_python(SCRIPTS / "every_hook.py", "--out", tmp_path / "traced", "--exit-code", "3", env=env)
    assert (traced.returncode, traced.stdout) == (plain.returncode, plain.stdout) == (3, plain.stdout)
    assert "step 8 loss" in plain.stdout
    (trace,) = (tmp_path / "trace").glob("trace-*.jsonl")
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    assert {e["what"] for e in events if e["event"] == "lost"} == set(SIGHT)  # every hook failed, once
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(1, 9))  # every step counted


def test_a_verdict_says_what_the_doctor_lost_sight_of(cases):
    case = cases["failing_hooks"]
    diagnosis = case["facts"]["diagnosis"]
    assert case["code"] == 0 and diagnosis["cause"] == "exact" and diagnosis["missing"] == []
    assert diagnosis["headline"].endswith("it lost sight of the batch, samples read, lr and 12 more from step 6")
    lost = {(row["run"], row["what"]) for row in diagnosis["lost"]}
    assert ("straight", "the batch") in lost and all(row["step"] >= 6 for row in diagnosis["lost"])
    assert "note: the doctor lost sight of the batch from step 6 of the straight run" in case["verdict"]
    assert diagnosis["equal"]["batch"] == [True] * 5 + [None] * 3  # steps 6..8 not compared
    log = (Path(case["folder"]) / "doctor" / "logs" / "straight.log").read_text()
    assert "step 8 loss" in log and "read back the checkpoint of step 8" in log  # the script went on to its end


@pytest.mark.parametrize("case", ["stream", "stream_none"])
def test_a_dataloader_over_an_iterable_dataset(cases, case):
    truth = cases[f"{case}_by_hand"]
    assert truth["drew_step"] == [1, 2, 3, 4] and not truth["weights_equal"]  # by hand: the resume replays the start
    diagnosis = cases[case]["facts"]["diagnosis"]
    assert cases[case]["code"] == 1 and diagnosis["cause"] == "data_position_lost", diagnosis["headline"]
    assert "an IterableDataset (ShuffledStream)" in diagnosis["headline"] and diagnosis["first_step"] == 5
    assert any("restarted from the first batch" in line for line in diagnosis["evidence"])


def test_runs_that_hash_differently_are_refused():
    def runs(*hashes):
        return SimpleNamespace(**{name: SimpleNamespace(hashes={h}) for name, h in zip(RUNS, hashes, strict=True)})

    one_hash(runs("xxh3_64", "xxh3_64", "xxh3_64"))
    with pytest.raises(UserError, match="blake2b-64 in the resumed run"):
        one_hash(runs("xxh3_64", "xxh3_64", "blake2b-64"))


def test_the_standard_library_hash_sees_what_xxh3_sees():
    from exactresume.doctor.tracer import fingerprint as fp

    a, saved = torch.arange(6, dtype=torch.float32), (fp.new_hasher, fp.HASH)
    try:
        fp.use_stdlib_hash()
        assert fp.HASH == "blake2b-64" and len(fp.digest(a)) == 16
        assert fp.digest(a) == fp.digest(a.clone()) == fp.digest(a.reshape(2, 3).t().contiguous().t().reshape(-1))
        assert len({fp.digest(a), fp.digest(a.half()), fp.digest(a.reshape(2, 3)), fp.digest(a + 1)}) == 4
    finally:
        fp.new_hasher, fp.HASH = saved


def test_the_standard_library_hash_can_be_forced_where_xxhash_is_installed():
    pytest.importorskip("xxhash")
    ask = [sys.executable, "-c", "from exactresume.doctor.tracer import fingerprint as f; print(f.HASH)"]
    hashes = [
        subprocess.run(ask, env=os.environ | extra, capture_output=True, text=True, check=True).stdout.strip()
        for extra in ({"EXACTRESUME_TRACE_HASH": "blake2b"}, {"EXACTRESUME_TRACE_HASH": ""})
    ]
    assert hashes == ["blake2b-64", "xxh3_64"]
