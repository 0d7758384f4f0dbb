"""The one line each framework gets (exactresume.integrations), on scripts written as its docs show
(tests/doctor_scripts): the framework's own checkpoints, resumed in a new process with its own resume
call, end where the uninterrupted run ends.

Each framework's straight run saves every step and records every step's batch and its final weights.
Copies of its checkpoints are resumed, each in a folder of its own: mid-epoch (step 3, of 6 an epoch),
at the epoch's last batch (6), after the next epoch's first (7), and twice (from 3, then from that
resumed run's own checkpoint at 8). Every batch and the final weights are compared with torch.equal.
Each script draws random numbers where that framework's own resume loses them (dropout under
Lightning's loader workers; a collate function that masks from the global RNG under the Trainer and
Accelerate). What the same resumes give without the line is established in test_doctor_frameworks.py,
by hand and by the doctor.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from helpers import FORKED_TORCHRUN, FRAMEWORK_MODULES, OFFLINE, once_per_session, run_python

SCRIPTS = Path(__file__).parent / "doctor_scripts"
STEPS = 10
SAMPLES, BATCH = 48, 8  # the scripts' Accelerate and Lightning data; the Trainer's: 24 samples of 4
TORCHRUN = (str(FORKED_TORCHRUN), "2")  # its ranks forked from the server that imported the frameworks


@dataclass(frozen=True)
class Framework:
    script: str
    checkpoint: str  # the name of the checkpoint the script saves at a step, from its step and epoch
    flags: tuple[str, ...]  # the line (--exact), and what makes its own resume lose draws
    stops: tuple[int, ...] = (3, 6, 7)  # mid-epoch, the epoch's last batch, the next epoch's first
    twice: tuple[int, int] | None = (3, 8)  # resumed at the first, and that run resumed at the second
    copied_as: str | None = None  # the name its resume looks for (Lightning's ckpt_path="last")
    batches_per_step: int = 1
    ranks: int = 1  # processes: each records its own batches, RECORD-0.pt, RECORD-1.pt
    launcher: tuple[str, ...] = ()  # torchrun's arguments, before the script (Lightning launches its own)
    said: str | None = None  # the one line a resume of it says (what it cannot do without reading)

    def name_at(self, step: int) -> str:
        batches_per_epoch = SAMPLES // BATCH // self.ranks
        epoch = (step * self.batches_per_step - 1) // batches_per_epoch
        return self.checkpoint.format(step=step, epoch=epoch)

    def records(self, base: Path) -> list[Path]:
        if self.ranks == 1:
            return [base.with_suffix(".pt")]
        return [base.with_name(f"{base.name}-{rank}.pt") for rank in range(self.ranks)]


FRAMEWORKS = {
    "lightning": Framework(
        "lightning_checkpoint",
        "epoch={epoch}-step={step}.ckpt",
        ("--exact", "--workers", "2", "--persistent", "--generator"),
        copied_as="last.ckpt",
    ),
    # validated every 4 steps, after step 4's checkpoint is saved: a resume from it does not validate again
    "lightning_validating": Framework(
        "lightning_checkpoint", "epoch={epoch}-step={step}.ckpt", ("--exact", "--validate"), (4,), None, "last.ckpt"
    ),
    "trainer": Framework("hf_trainer", "checkpoint-{step}", ("--exact", "--mask-tokens")),
    "trainer_accumulating": Framework(  # 2 batches a step: 3 steps an epoch
        "hf_trainer", "checkpoint-{step}", ("--exact", "--mask-tokens", "--accumulate", "2"), (2, 3), None, None, 2
    ),
    "accelerate": Framework("accelerate_loop", "step_{step}", ("--exact", "--mask")),
    "trainer_workers": Framework("hf_trainer", "checkpoint-{step}", ("--exact", "--workers", "2"), (3,), None),
    # a datasets stream through a shuffle buffer: exact, by reading the batches the loop took again
    "trainer_stream": Framework(
        "hf_trainer",
        "checkpoint-{step}",
        ("--exact", "--mask-tokens", "--stream"),
        (3,),
        None,
        said="reads an IterableDataset, which has no index to skip to",
    ),
    # two processes, 3 batches an epoch each: mid-epoch and the epoch's last batch
    "lightning_ddp": Framework(
        "lightning_checkpoint",
        "epoch={epoch}-step={step}.ckpt",
        ("--exact", "--devices", "2"),
        (2, 3),
        None,
        "last.ckpt",
        ranks=2,
    ),
    "accelerate_torchrun": Framework(
        "accelerate_loop", "step_{step}", ("--exact", "--mask"), (2, 3), None, ranks=2, launcher=TORCHRUN
    ),
}


def run(framework: Framework, out: Path, record: Path, *more: str) -> str:
    """The script, to STEPS, saving every step; `record`: its batches and weights (RECORD.pt, or one a rank)."""
    script = SCRIPTS / f"{framework.script}.py"
    record = record if framework.ranks > 1 else record.with_suffix(".pt")
    flags = ["--out", out, "--steps", STEPS, "--save-every", 1, *framework.flags, "--record", record, *more]
    program, *launched = [*framework.launcher, script]
    finished = run_python(Path(program), *launched, *flags, env=OFFLINE, preload=FRAMEWORK_MODULES)
    assert finished.returncode == 0, finished.stdout[-3000:]
    return finished.stdout


def resume_copy(framework: Framework, source: Path, step: int, folder: Path, *more: str) -> str:
    """The checkpoint `source` saved at `step`, copied alone into `folder` and resumed there."""
    folder.mkdir(parents=True)
    name = framework.name_at(step)
    copy = shutil.copytree if (source / name).is_dir() else shutil.copy2
    copy(source / name, folder / (framework.copied_as or name))
    return run(framework, folder, folder, "--resume", *more)


def said(output: str) -> list[str]:
    """exactresume's own lines in what a run printed."""
    return [line for line in output.splitlines() if line.startswith("exactresume:")]


def compare(framework: Framework, straight: Path, resumed: Path, step: int) -> dict:
    """Every rank's batches after `step` and its final weights, against the straight run's."""
    found: dict = {"batches": [0, 0], "same_batch": [], "weights_equal": True}
    for straight_record, resumed_record in zip(framework.records(straight), framework.records(resumed)):
        a, b = torch.load(straight_record), torch.load(resumed_record)
        later = a["batches"][step * framework.batches_per_step :]
        found["batches"] = [found["batches"][0] + len(later), found["batches"][1] + len(b["batches"])]
        found["same_batch"] += [torch.equal(x, y) for x, y in zip(later, b["batches"])]
        found["weights_equal"] &= all(torch.equal(a["weights"][name], b["weights"][name]) for name in a["weights"])
    return found


def prove(root: Path, name: str) -> tuple[str, dict]:
    framework, folder = FRAMEWORKS[name], root / name
    straight = folder / "straight"
    run(framework, straight, folder / "straight")
    found: dict = {"stops": {}, "notices": {}, "folder": str(folder)}
    with ThreadPoolExecutor(2) as pool:
        resumed = {
            step: pool.submit(resume_copy, framework, straight, step, folder / f"at-{step}") for step in framework.stops
        }
        for step, output in resumed.items():
            found["notices"][step] = said(output.result())
            found["stops"][step] = compare(framework, folder / "straight", folder / f"at-{step}", step)
    if framework.twice:
        first, second = framework.twice
        resume_copy(framework, folder / f"at-{first}", second, folder / "twice")
        found["twice"] = compare(framework, folder / "straight", folder / "twice", second)
    return name, found


@pytest.fixture(scope="module")
def proofs(tmp_path_factory) -> dict:
    def every_framework(root: Path) -> dict:
        with ThreadPoolExecutor(2) as pool:
            return dict(pool.map(lambda name: prove(root, name), FRAMEWORKS))

    return once_per_session(tmp_path_factory, "integrations", every_framework)


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_each_stop_resumes_exactly(proofs, name):
    for step, found in proofs[name]["stops"].items():
        framework = FRAMEWORKS[name]
        expected = (STEPS - int(step)) * framework.batches_per_step * framework.ranks
        assert found["batches"] == [expected, expected], (step, found)
        assert all(found["same_batch"]) and found["weights_equal"], (step, found)
        notices = proofs[name]["notices"][step]
        expected = [framework.said] if framework.said else []
        assert [next((said for said in expected if said in line), line) for line in notices] == expected, notices


@pytest.mark.parametrize("name", [name for name, framework in FRAMEWORKS.items() if framework.twice])
def test_resumed_twice(proofs, name):
    found = proofs[name]["twice"]
    assert found["batches"][0] == found["batches"][1] > 0
    assert all(found["same_batch"]) and found["weights_equal"], found


# Without the line: what each framework's own save and resume do with the other's checkpoints, as its docs show
SAVED_WITHOUT = {"lightning": "lightning", "trainer": "trainer", "accelerate": "accelerate"}


def without_the_line(framework: Framework) -> Framework:
    return Framework(framework.script, framework.checkpoint, tuple(f for f in framework.flags if f != "--exact"))


def other_sides(root: Path, name: str, straight: Path) -> tuple[str, dict]:
    """A checkpoint of the line resumed without it; one saved without it resumed with it; a kill mid-save."""
    framework, folder = FRAMEWORKS[name], root / name
    plain = without_the_line(framework)
    found = {"ours_resumed_plain": resume_copy(plain, straight, 3, folder / "ours-plain")}
    run(plain, folder / "plain", folder / "plain", "--steps", "4")  # the last --steps wins
    found["plain_resumed_with_line"] = resume_copy(framework, folder / "plain", 3, folder / "plain-ours")
    killed = run_killed(framework, folder / "killed", 5)
    found["killed"] = killed | compare(framework, straight, folder / "killed-resumed", 4)
    found["killed_plain"] = run_killed(plain, folder / "killed-plain", 5, resumes=False)
    return name, found


def run_killed(framework: Framework, out: Path, step: int, resumes: bool = True) -> dict:
    """Killed (SIGKILL) while the framework writes step's checkpoint, then resumed in the same folder."""
    script = SCRIPTS / f"{framework.script}.py"
    flags = ["--out", out, "--steps", STEPS, "--save-every", 1, *framework.flags]
    killed = run_python(script, *flags, "--kill-in-save", step, env=OFFLINE, preload=FRAMEWORK_MODULES)
    if not resumes:  # the framework's own resume, expected to fail: its code and its last words
        failed = run_python(script, *flags, "--resume", env=OFFLINE, preload=FRAMEWORK_MODULES)
        return {"killed_code": killed.returncode, "code": failed.returncode, "last": failed.stdout.strip()[-300:]}
    printed = run(framework, out, out.with_name("killed-resumed"), "--resume")
    return {
        "killed_code": killed.returncode,
        "notices": [line for line in printed.splitlines() if "exactresume" in line],
    }


@pytest.fixture(scope="module")
def sides(proofs, tmp_path_factory) -> dict:
    def every_framework(root: Path) -> dict:
        straights = {name: Path(proofs[name]["folder"]) / "straight" for name in SAVED_WITHOUT}
        with ThreadPoolExecutor(2) as pool:
            return dict(pool.map(lambda name: other_sides(root, name, straights[name]), SAVED_WITHOUT))

    return once_per_session(tmp_path_factory, "integration-sides", every_framework)


@pytest.mark.parametrize("name", SAVED_WITHOUT)
def test_a_checkpoint_stays_the_frameworks_own(sides, name):
    """Resumed without the line, a checkpoint saved with it runs as the framework runs it (no error)."""
    assert said(sides[name]["ours_resumed_plain"]) == []


@pytest.mark.parametrize("name", SAVED_WITHOUT)
def test_a_checkpoint_saved_without_the_line_is_said_and_resumed(sides, name):
    lines = said(sides[name]["plain_resumed_with_line"])
    assert len(lines) == 1 and "saved without it" in lines[0], lines


# What the framework's own resume meets after the kill, without the line (tests/doctor_scripts say how it is killed)
CUT_SHORT = {
    "lightning": "OSError",  # half of last.ckpt
    "trainer": "trainer_state.json",  # a checkpoint folder without it
    "accelerate": "optimizer.bin",  # a save_state folder with the weights and nothing after
}


@pytest.mark.parametrize("name", SAVED_WITHOUT)
def test_killed_while_the_framework_writes_then_resumed(sides, name):
    """Without the line, the same kill leaves a checkpoint the framework's own resume fails on; with it,
    the resume takes the last whole checkpoint and ends where the straight run ends."""
    plain = sides[name]["killed_plain"]
    assert plain["killed_code"] == -9 and plain["code"] != 0 and CUT_SHORT[name] in plain["last"], plain
    found = sides[name]["killed"]
    assert found["killed_code"] == -9
    assert all(found["same_batch"]) and found["weights_equal"] and found["batches"][0] == found["batches"][1] > 0
    if name == "trainer":
        assert len(found["notices"]) == 1 and "checkpoint-5 is not a whole checkpoint" in found["notices"][0]
