"""`exactresume doctor` on the frameworks people train with: Hugging Face's Trainer, Accelerate,
Lightning, torchrun, and a plain loop's subtle DataLoader case.

Each verdict is checked against the truth found by hand, outside the doctor: a straight run records
every step's batch and its final weights, a copy of its checkpoint at the resume step is resumed in
a folder of its own, and the two are compared with torch.equal. Every case (the doctor, and the runs
by hand) runs once per session, side by side; nothing is downloaded (the scripts build their models).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from exactresume.cli import main
from helpers import (
    FORKED_TORCHRUN,
    FRAMEWORK_MODULES,
    OFFLINE,
    assert_one_line_error,
    call_cli,
    once_per_session,
    spawn_python,
    stable_environ,
)

SCRIPTS = Path(__file__).parent / "doctor_scripts"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
# The truth by hand forks its ranks (as torchrun would start them, less the imports); the doctor runs torchrun
TWO_FORKED_RANKS = (sys.executable, str(FORKED_TORCHRUN), "2")


@dataclass(frozen=True)
class Case:
    script: str
    checkpoint: str  # what the straight run saved at the resume step, copied for the resume by hand
    resume_step: int
    extra: tuple[str, ...] = ()
    launcher: tuple[str, ...] = (sys.executable,)
    copied_as: str | None = None  # the copy's name, where the resume looks for another (Lightning's last.ckpt)

    def command(self, out: Path, *more: str) -> list[str]:
        return [*self.launcher, str(SCRIPTS / f"{self.script}.py"), "--out", str(out), *self.extra, *more]


CASES = {
    "hf_trainer": Case("hf_trainer", "checkpoint-4", 4),
    "hf_trainer_masking": Case("hf_trainer", "checkpoint-4", 4, ("--mask-tokens",)),
    "accelerate_loop": Case("accelerate_loop", "step_4", 4),
    "lightning_checkpoint": Case("lightning_checkpoint", "epoch=0-step=4.ckpt", 4, copied_as="last.ckpt"),
    "torchrun_rank_sampler": Case("torchrun_rank_sampler", "step-6.pt", 6, launcher=tuple(TORCHRUN)),
    "dataloader_base_seed": Case("dataloader_base_seed", "step-4.pt", 4),
    # exactresume's one line for each framework (docs/frameworks.md), on the scripts above
    "lightning_exact": Case("lightning_checkpoint", "epoch=0-step=4.ckpt", 4, ("--exact",), copied_as="last.ckpt"),
    "accelerate_exact": Case("accelerate_loop", "step_4", 4, ("--exact",)),
    "hf_trainer_masking_exact": Case("hf_trainer", "checkpoint-4", 4, ("--mask-tokens", "--exact")),
}
EXACT = ("lightning_exact", "accelerate_exact", "hf_trainer_masking_exact")


# Its doctor runs as the user runs it, a cold process each; the others fork theirs (--warm --preload).
COLD = "hf_trainer"

# The fixes the doctor names, applied (--fixed) and checked by hand only: each resumes exactly.
FIXED = {name: replace(CASES[name], extra=("--fixed",)) for name in ("accelerate_loop", "dataloader_base_seed")}


def by_hand(case: Case, folder: Path) -> dict:
    """The straight run and a resumed copy of its checkpoint, outside the doctor: per rank, which of
    the resumed steps drew the straight run's batch, which straight step each resumed batch matches,
    and whether the final weights are equal."""
    straight, resumed = folder / "straight", folder / "resumed"
    hand = replace(case, launcher=TWO_FORKED_RANKS) if case.launcher == tuple(TORCHRUN) else case
    run_script(hand.command(straight, "--record", str(folder / "a")), folder / "straight.log")
    resumed.mkdir(parents=True)
    copy = shutil.copytree if (straight / case.checkpoint).is_dir() else shutil.copy2
    copy(straight / case.checkpoint, resumed / (case.copied_as or case.checkpoint))
    run_script(hand.command(resumed, "--resume", "--record", str(folder / "b")), folder / "resumed.log")
    suffixes = ["-0.pt", "-1.pt"] if case.launcher != (sys.executable,) else [""]
    return {str(rank): compare(folder / f"a{s}", folder / f"b{s}", case.resume_step) for rank, s in enumerate(suffixes)}


# The scripts that import a framework (or datasets); the others import torch alone.
FRAMEWORK_SCRIPTS = {"hf_trainer", "lightning_checkpoint", "accelerate_loop", "hf_streaming"}


def run_script(command: list[str], log: Path) -> None:
    """Each a new process, forked (see test_doctor.py); a framework's script from a server that imported
    the frameworks once, as test_integrations.py's runs are: the truth by hand need not pay their imports
    again (the doctor's own runs, forked from a server that holds torch alone, pay them as a user's do).
    The other scripts fork from that one: a fork of the larger server costs them more than it saves."""
    log.parent.mkdir(parents=True, exist_ok=True)
    framework = any(Path(word).stem in FRAMEWORK_SCRIPTS for word in command if word.endswith(".py"))
    code = spawn_python(command, log, OFFLINE, FRAMEWORK_MODULES if framework else ()).wait()
    assert code == 0, f"{command} exited {code}: {log.read_text()[-2000:]}"


def compare(straight_record: Path, resumed_record: Path, k: int) -> dict:
    a, b = torch.load(straight_record), torch.load(resumed_record)
    first, later = a["batches"][:k], a["batches"][k:]
    return {
        "same_batch": [torch.equal(x, y) for x, y in zip(later, b["batches"])],  # "steps" says how many each took
        "drew_step": [
            next((i + 1 for i, x in enumerate(a["batches"]) if torch.equal(x, y)), None) for y in b["batches"]
        ],
        "weights_equal": all(torch.equal(a["weights"][name], b["weights"][name]) for name in a["weights"]),
        "steps": [len(first), len(b["batches"])],
    }


def doctor_args(case: Case, folder: Path, warm: bool) -> list[str]:
    """Warm, its server imports the frameworks too (--preload), as for the truth by hand: each run then
    pays the script's own imports only."""
    # `--resume-args --resume` as two words, as a user types it
    flags = ["--steps", "8", "--stop-after", "4", "--out", str(folder / "doctor"), "--resume-args", "--resume"]
    flags += ["--warm", "--preload", ",".join(FRAMEWORK_MODULES)] if warm else []
    return ["doctor", *flags, "--", *case.command(folder / "out")]


def run_case(root: Path, name: str) -> tuple[str, dict]:
    case, folder = CASES[name], root / name
    with ThreadPoolExecutor(1) as hand:
        truth = hand.submit(by_hand, case, folder / "by_hand")
        fixed = hand.submit(by_hand, FIXED[name], folder / "fixed") if name in FIXED else None
        code = main(doctor_args(case, folder, warm=name != COLD))
        facts = json.loads((folder / "doctor" / "doctor.json").read_text())
        verdict = (folder / "doctor" / "verdict.txt").read_text()
        found = {"code": code, "verdict": verdict, "facts": facts, "truth": truth.result(), "folder": str(folder)}
        return name, found | {"fixed": fixed.result() if fixed else None}


@pytest.fixture(scope="module")
def frameworks(tmp_path_factory) -> dict:
    """Every case through the doctor and by hand, once: name -> code, verdict, doctor.json, truth."""

    def every_case(root: Path) -> dict:
        with ThreadPoolExecutor(3) as pool:
            return dict(pool.map(lambda name: run_case(root, name), CASES))

    with stable_environ():
        return once_per_session(tmp_path_factory, "frameworks", every_case)


def diagnosis(frameworks, name) -> dict:
    return frameworks[name]["facts"]["diagnosis"]


def test_the_trainer_as_its_docs_show_is_exact(frameworks):
    truth = frameworks["hf_trainer"]["truth"]["0"]
    assert truth["same_batch"] == [True] * 4 and truth["weights_equal"]  # by hand: the Trainer resumes exactly
    assert frameworks["hf_trainer"]["code"] == 0, frameworks["hf_trainer"]["verdict"]
    assert diagnosis(frameworks, "hf_trainer")["cause"] == "exact"
    assert diagnosis(frameworks, "hf_trainer")["missing"] == []
    out = Path(frameworks["hf_trainer"]["folder"]) / "out"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-8"]
    assert (out / "checkpoint-8" / "trainer_state.json").is_file()  # the straight run's, back in place


@pytest.mark.parametrize("name", [COLD, "hf_trainer_masking"], ids=["cold", "preloaded"])
def test_the_trainers_weights_files_are_seen_and_put_back_cold_or_preloaded(frameworks, name):
    """With transformers imported before the run began (--preload), its `from safetensors.torch import
    save_file` holds the function the tracer wraps only once the tracer binds its wrapper there too: else
    the doctor lost sight of model.safetensors, and the resume's copies stayed in its own folder."""
    out = Path(frameworks[name]["folder"]) / "out"
    for checkpoint in ("checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-8"):
        assert (out / checkpoint / "model.safetensors").is_file(), checkpoint
    notes = frameworks[name]["verdict"]
    assert "GPT2LMHeadModel" not in notes, notes  # the model is in every checkpoint, not "not in the checkpoint"


def test_the_trainer_restores_the_rng_after_the_first_batch(frameworks):
    truth = frameworks["hf_trainer_masking"]["truth"]["0"]
    assert not truth["same_batch"][0] and not truth["weights_equal"]  # by hand: step 5 is masked otherwise
    found = diagnosis(frameworks, "hf_trainer_masking")
    assert found["cause"] == "batch_randomness" and found["first_step"] == 5, found["headline"]
    assert "restored the RNG state only after it had drawn its first batch" in found["headline"]
    assert any("no TrainingArguments setting" in fix for fix in found["fixes"])
    assert any("exactresume.trainer_resume(Trainer(...))" in fix for fix in found["fixes"])  # the line that cures it


def test_accelerate_names_the_sampler_that_draws(frameworks):
    truth = frameworks["accelerate_loop"]["truth"]["0"]
    assert truth["drew_step"][0] is None and not truth["weights_equal"]  # by hand: reshuffled
    found = diagnosis(frameworks, "accelerate_loop")
    assert found["causes"] == ["data_position_lost", "rng_after_iterator"], found["headline"]
    assert "Accelerate's DataLoaderShard" in found["headline"] and "SequentialSampler" not in found["headline"]
    assert "RandomSampler drawing its seed from the global torch RNG" in found["headline"]
    assert any("use_seedable_sampler=True" in fix for fix in found["fixes"])
    assert any("generator=torch.Generator()" in fix for fix in found["fixes"])
    assert any("exactresume.accelerate_resume(accelerator, loader)" in fix for fix in found["fixes"])
    fixed = frameworks["accelerate_loop"]["fixed"]["0"]
    assert fixed["same_batch"] == [True] * 4 and fixed["weights_equal"]  # by hand: those fixes make it exact


def test_lightning_steps_are_filed_under_their_own_step(frameworks):
    truth = frameworks["lightning_checkpoint"]["truth"]["0"]
    assert truth["drew_step"][:2] == [1, 2] and not truth["weights_equal"]  # by hand: the epoch restarts
    found = diagnosis(frameworks, "lightning_checkpoint")
    assert found["causes"] == ["data_position_lost", "rng_lost"] and found["first_step"] == 5, found["headline"]
    assert any("drew step 1's batch" in line for line in found["evidence"])
    assert any("StatefulDataLoader" in fix for fix in found["fixes"])
    assert any("exactresume.lightning_resume()" in fix for fix in found["fixes"])
    straight = frameworks["lightning_checkpoint"]["facts"]["runs"]["straight"]["steps"]
    assert len({step["batch"] for step in straight}) == 8  # each closure step holds its own batch


@pytest.mark.parametrize("name", EXACT)
def test_with_the_line_the_doctor_says_exact(frameworks, name):
    """The scripts whose resume the doctor faults above, with exactresume's line for their framework."""
    truth = frameworks[name]["truth"]["0"]
    assert truth["same_batch"] == [True] * 4 and truth["weights_equal"], truth  # by hand
    found = diagnosis(frameworks, name)
    assert frameworks[name]["code"] == 0 and found["cause"] == "exact", found["headline"]
    assert found["missing"] == []


def test_torchrun_names_the_rank_whose_sampler_parts(frameworks):
    truth = frameworks["torchrun_rank_sampler"]["truth"]
    assert truth["0"]["same_batch"] == [True, True] and truth["1"]["same_batch"][0] is False  # by hand
    found = diagnosis(frameworks, "torchrun_rank_sampler")
    assert found["headline"].startswith("on rank 1 (of 2): the data position was lost"), found["headline"]
    assert found["first_step"] == 7 and any(line.startswith("rank 0: differs at step 7") for line in found["evidence"])
    assert any(row["name"] == "rank 1's sampler generator" for row in found["missing"])
    ranks = frameworks["torchrun_rank_sampler"]["facts"]["runs"]["interrupted"]["ranks"]
    assert sorted(ranks) == ["0", "1"] and ranks["0"]["end"] == 87  # ended as a crash would, after its save
    assert [r["steps"] for r in ranks.values()] == [6, 6]  # and rank 1 with it, at the same step


def test_a_dataloader_without_generator_shifts_the_restored_rng(frameworks):
    truth = frameworks["dataloader_base_seed"]["truth"]["0"]
    assert truth["same_batch"] == [True] * 4 and not truth["weights_equal"]  # by hand: same batches, other masks
    found = diagnosis(frameworks, "dataloader_base_seed")
    assert found["cause"] == "rng_after_iterator", found["headline"]
    assert "DataLoader without generator=" in found["headline"]
    assert frameworks["dataloader_base_seed"]["facts"]["plan"]["resume_args"] == ["--resume"]  # typed as two words
    fixed = frameworks["dataloader_base_seed"]["fixed"]["0"]
    assert fixed["same_batch"] == [True] * 4 and fixed["weights_equal"]  # by hand: generator= makes it exact


@pytest.mark.parametrize("warm", [[], ["--warm"]], ids=["cold", "warm"])
def test_a_framework_that_is_not_installed(tmp_path, warm):
    command = ["--", sys.executable, str(SCRIPTS / "missing_framework.py")]
    finished = call_cli("doctor", "--steps", "8", "--stop-after", "4", "--out", tmp_path / "d", *warm, *command)
    assert_one_line_error(finished, "needs 'lightning'", "does not have")


def test_a_module_to_preload_that_does_not_import_stops_the_doctor_in_one_line(tmp_path):
    """--preload reaches the server's imports: a module it cannot import is named before any run starts."""
    command = ["--", sys.executable, str(SCRIPTS / "dataloader_base_seed.py"), "--out", str(tmp_path / "out")]
    flags = ["--steps", "8", "--stop-after", "4", "--out", tmp_path / "d"]
    finished = call_cli("doctor", *flags, "--preload", "accelerate", "--preload", "no_such_framework", *command)
    assert_one_line_error(finished, "did not start", "No module named 'no_such_framework'")
    assert not (tmp_path / "out").exists()
    finished = call_cli("doctor", *flags, "--preload", "transformers trainer", *command)
    assert_one_line_error(finished, "--preload: 'transformers trainer' is not a module's name")
    finished = call_cli("doctor", *flags, "--preload", "", "--warm", *command)
    assert_one_line_error(finished, "--preload names no module")


def test_a_script_that_never_checkpoints(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("the user's own file")
    command = [sys.executable, str(SCRIPTS / "dataloader_base_seed.py"), "--out", str(tmp_path / "out")]
    flags = ["--steps", "8", "--stop-after", "4", "--out", tmp_path / "d", "--resume-args", "--resume", "--warm"]
    finished = call_cli("doctor", *flags, "--", *command, "--save-every", "100")
    assert_one_line_error(finished, "saved no checkpoint", "it saved nothing the doctor could see")
    assert sorted(os.listdir(tmp_path / "out")) == ["notes.txt"]
    assert (tmp_path / "out" / "notes.txt").read_text() == "the user's own file"


def test_torchrun_ranks_that_disagree_on_the_step_count(tmp_path):
    command = [*TORCHRUN, str(SCRIPTS / "torchrun_uneven.py"), "--out", str(tmp_path / "out")]
    flags = ["--steps", "8", "--stop-after", "4", "--out", tmp_path / "d", "--warm"]
    finished = call_cli("doctor", *flags, "--", *command)
    assert_one_line_error(finished, "ranks disagree on the step count", "rank 0 took 8", "rank 1 took 6")
    assert sorted(os.listdir(tmp_path / "out")) == ["rank0.pt", "rank1.pt"]  # the straight run's, put back


def test_resume_args_as_typed(tmp_path):
    flags = ["--steps", "8", "--stop-after", "4", "--out", tmp_path / "d", "--resume-args", "--from_resume", "1"]
    finished = call_cli("doctor", *flags, "--", sys.executable, "train.py")
    assert_one_line_error(finished, "--resume-args='--from_resume 1'")


def an_older_checkpoint(tmp_path: Path, name: str) -> tuple[list[str], Path, bytes]:
    """The script's folder holding a checkpoint of an earlier run, under `name`, the newest its resume finds."""
    command = [sys.executable, str(SCRIPTS / "dataloader_base_seed.py"), "--out", str(tmp_path / "out")]
    run_script([*command, "--steps", "2"], tmp_path / "earlier.log")
    older = tmp_path / "out" / name
    (tmp_path / "out" / "step-2.pt").rename(older)
    return command, older, older.read_bytes()


DOCTOR_FLAGS = ["--steps", "8", "--stop-after", "4", "--resume-args", "--resume", "--warm"]


def test_an_earlier_runs_checkpoint_beside_the_interrupted_runs_is_set_aside_for_the_resume_and_kept(tmp_path):
    command, older, before = an_older_checkpoint(tmp_path, "step-100.pt")  # named as the script names its own
    finished = call_cli("doctor", *DOCTOR_FLAGS, "--out", tmp_path / "d", "--", *command)
    assert finished.returncode == 1, finished.stderr  # the verdict of the case itself (CASES), not a refusal
    facts = json.loads((tmp_path / "d" / "doctor.json").read_text())
    assert facts["diagnosis"]["cause"] == "rng_after_iterator", facts["diagnosis"]["headline"]
    assert f"{older}, an earlier run's checkpoints beside the interrupted run's, were set aside" in finished.stdout
    assert older.read_bytes() == before  # and the straight run's own checkpoints are back beside it
    assert sorted(os.listdir(tmp_path / "out")) == ["step-100.pt", "step-2.pt", "step-4.pt", "step-6.pt", "step-8.pt"]


def test_checkpoint_folders_published_over_an_earlier_runs_are_put_back_and_the_newer_set_aside(tmp_path):
    """exactresume's lines publish a checkpoint folder over an older one by an atomic exchange, which no
    hook of os sees: the doctor still keeps what the user had, and its resume finds the interrupted run's."""
    command = [sys.executable, str(SCRIPTS / "correct_handwritten.py"), "--out", str(tmp_path / "out"), "--folders"]
    run_script(command, tmp_path / "earlier.log")  # the user's earlier run: step-2 ... step-8
    before = {path.parent.name: path.read_bytes() for path in (tmp_path / "out").glob("step-*/resume.pt")}
    assert sorted(before) == ["step-2", "step-4", "step-6", "step-8"]
    finished = call_cli("doctor", *DOCTOR_FLAGS, "--out", tmp_path / "d", "--", *command)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "exact: steps 5..8 are bit-identical" in finished.stdout
    assert f"{tmp_path / 'out' / 'step-6'} and {tmp_path / 'out' / 'step-8'}, an earlier run's" in finished.stdout
    after = {path.parent.name: path.read_bytes() for path in (tmp_path / "out").glob("step-*/resume.pt")}
    assert after == before  # each folder as it was, not the doctor's runs' versions
    assert sorted(os.listdir(tmp_path / "out")) == ["step-2", "step-4", "step-6", "step-8"]
    assert all(os.listdir(folder) == ["resume.pt"] for folder in (tmp_path / "out").iterdir())  # nothing moved in
    again = call_cli("doctor", *DOCTOR_FLAGS, "--out", tmp_path / "d", "--", *command)  # the same, once more
    assert again.returncode == 0 and "exact: steps 5..8" in again.stdout, again.stdout + again.stderr
    assert {path.parent.name: path.read_bytes() for path in (tmp_path / "out").glob("step-*/resume.pt")} == before
    assert all(os.listdir(folder) == ["resume.pt"] for folder in (tmp_path / "out").iterdir())


def test_an_older_checkpoint_named_otherwise_found_by_the_resume_is_named_and_kept(tmp_path):
    command, older, before = an_older_checkpoint(tmp_path, "step-+100.pt")  # int() reads it; not step-N.pt
    finished = call_cli("doctor", *DOCTOR_FLAGS, "--out", tmp_path / "d", "--", *command)
    assert_one_line_error(finished, f"but {older}, which was there before the doctor")
    assert older.read_bytes() == before
    assert sorted(os.listdir(tmp_path / "out")) == ["step-+100.pt", "step-2.pt", "step-4.pt", "step-6.pt", "step-8.pt"]
