"""A user's own loop (tests/users/programs/user_loop.py, written from docs/library.md alone) meets a
CheckpointStore as scripts change and mistakes happen: a part added or renamed, a model of another
width, a full disk, a negative step, `keep`, a damaged newest checkpoint, and `diff` / `inspect` on
the files. Each version of the script runs in its own process; each case checks that no checkpoint
file changed or disappeared that should not have."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from exactresume import (
    CheckpointError,
    CheckpointStore,
    GeneratorPart,
    GlobalRng,
    UserError,
    load_resume,
    save_resume,
)
from helpers import call_cli, run_python

PROGRAM = Path(__file__).parent / "programs" / "user_loop.py"


def step_file(step: int) -> str:
    return f"step-{step:08d}.pth"


def fingerprints(folder: Path) -> dict[str, str]:
    """Every file of the checkpoint folder, by name, and the hash of its bytes (the writer's lock aside)."""
    files = [path for path in sorted(folder.iterdir()) if path.name != ".exactresume.lock"]
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in files}


def last_line_with(output: str, start: str) -> str:
    return next(line for line in reversed(output.splitlines()) if line.startswith(start))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The first version of the script, run to step 30: checkpoints at 10, 20 and 30."""
    folder = tmp_path_factory.mktemp("first-version") / "run"
    finished = run_python(PROGRAM, folder, "--steps", 30)
    assert finished.returncode == 0, finished.stdout
    assert sorted(fingerprints(folder)) == ["final.pt", step_file(10), step_file(20), step_file(30)]
    return folder


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The same script run to step 40 at once."""
    folder = tmp_path_factory.mktemp("straight") / "run"
    assert run_python(PROGRAM, folder, "--steps", 40).returncode == 0
    return folder / "final.pt"


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of the trained folder for one case to change."""
    return Path(shutil.copytree(trained, tmp_path / "run"))


def assert_same_weights(a: Path, b: Path) -> None:
    first, second = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_a_part_added_to_the_loop_costs_no_checkpoint(run):
    before = fingerprints(run)
    with_scheduler = ("--parts", "model,opt,data,rng,sched", "--steps", 40)
    refused = run_python(PROGRAM, run, *with_scheduler)
    assert refused.returncode == 2, refused.stdout
    line = last_line_with(refused.stdout, "load refused:")
    for needle in ("step-00000030.pth", "sched is not in the checkpoint", "fresh=['sched']", "nothing was loaded"):
        assert needle in line, line
    assert "damaged" not in line and "model unchanged: True" in refused.stdout
    assert fingerprints(run) == before
    # A script that catches the error and trains from step 0 anyway: its first save refuses.
    blind = run_python(PROGRAM, run, *with_scheduler, "--start-over-on-error")
    assert blind.returncode == 2, blind.stdout
    assert "could not be loaded into the parts given" in last_line_with(blind.stdout, "CheckpointError:")
    assert fingerprints(run) == before
    # The way the error names: the scheduler starts fresh, the run continues from step 30.
    resumed = run_python(PROGRAM, run, *with_scheduler, "--fresh", "sched")
    assert resumed.returncode == 0, resumed.stdout
    assert "trained steps 31 to 40" in resumed.stdout and "holds no part sched: it starts fresh" in resumed.stdout
    after = fingerprints(run)
    assert {name: after.get(name) for name in (step_file(20), step_file(30))} == {
        name: before[name] for name in (step_file(20), step_file(30))
    }
    assert step_file(40) in after and step_file(10) not in after  # keep=3 let the oldest go, after step 40 held
    # The next start finds the scheduler saved: the same command loads it, and says nothing of starting fresh.
    again = run_python(PROGRAM, run, *with_scheduler[:-1], 50, "--fresh", "sched")
    assert again.returncode == 0 and "trained steps 41 to 50" in again.stdout and "fresh" not in again.stdout


def test_a_renamed_part_is_named_on_both_sides_and_the_saved_name_resumes_exactly(run, straight):
    before = fingerprints(run)
    refused = run_python(PROGRAM, run, "--parts", "model,optim,data,rng", "--steps", 40)
    assert refused.returncode == 2, refused.stdout
    line = last_line_with(refused.stdout, "load refused:")
    needles = ("optim is not in the checkpoint", "opt is not given", "under its saved name (opt)", "and skip=['opt']")
    for needle in needles:
        assert needle in line, line
    assert fingerprints(run) == before
    resumed = run_python(PROGRAM, run, "--parts", "model,opt,data,rng", "--steps", 40)
    assert resumed.returncode == 0 and "trained steps 31 to 40" in resumed.stdout, resumed.stdout
    assert_same_weights(run / "final.pt", straight)


def test_a_model_of_another_shape_names_its_tensors_and_changes_nothing(run):
    before = fingerprints(run)
    refused = run_python(PROGRAM, run, "--width", 64, "--steps", 40)
    assert refused.returncode == 2, refused.stdout
    line = last_line_with(refused.stdout, "load refused:")
    assert "the part model does not fit" in line and "model.0.weight: saved [32, 8], given [64, 8]" in line, line
    assert "model unchanged: True" in refused.stdout and "Error(s) in loading" not in refused.stdout
    assert fingerprints(run) == before


def test_a_full_disk_is_a_storage_error_and_the_checkpoints_stay(run):
    before = fingerprints(run)
    full = run_python(PROGRAM, run, "--steps", 40, "--file-size-limit", 4096)
    assert full.returncode == 74, full.stdout
    line = last_line_with(full.stdout, "StorageError:")
    assert "checkpoint at step 40" in line and f"{step_file(30)} is intact" in line and "EFBIG" in line, line
    assert "Traceback" not in full.stdout
    assert fingerprints(run) == before  # no step 40, no .tmp, nothing pruned


def test_a_loop_that_never_loads_cannot_write_over_the_run(run):
    before = fingerprints(run)
    forgot = run_python(PROGRAM, run, "--no-load", "--steps", 40, "--keep", 1)
    assert forgot.returncode == 2, forgot.stdout
    line = last_line_with(forgot.stdout, "CheckpointError:")
    assert "already holds step-00000010.pth" in line and "has not loaded" in line, line
    assert fingerprints(run) == before
    # ... and one that goes on after each refusal, past the run's newest step: every save is refused.
    goes_on = run_python(PROGRAM, run, "--no-load", "--ignore-save-errors", "--steps", 60, "--keep", 1)
    assert goes_on.returncode == 0 and goes_on.stdout.count("save refused:") == 6, goes_on.stdout
    checkpoints = lambda found: {name: digest for name, digest in found.items() if name.startswith("step-")}  # noqa: E731
    assert checkpoints(fingerprints(run)) == checkpoints(before)


def test_a_file_the_load_passed_over_is_never_pruned(run):
    foreign = run / step_file(35)
    torch.save({"weight": torch.ones(3)}, foreign)  # not ours: no seal
    resumed = run_python(PROGRAM, run, "--steps", 70, "--keep", 3)
    assert resumed.returncode == 0 and "skipping" in resumed.stdout, resumed.stdout
    assert foreign.exists()  # passed over at the load, so never deleted by keep
    assert [n for n in fingerprints(run) if n.startswith("step-")] == [step_file(s) for s in (35, 50, 60, 70)]


def test_what_is_not_a_folder_or_not_parts_is_refused_in_one_line(tmp_path):
    mistakes = (lambda: CheckpointStore(5), lambda: CheckpointStore(tmp_path, background=1), lambda: GeneratorPart(5))
    for mistake in mistakes:
        with pytest.raises(UserError):
            mistake()
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(UserError, match="is a file, not a folder of checkpoints"):
        CheckpointStore(tmp_path / "a-file")
    with CheckpointStore(tmp_path / "store") as store:
        for parts in ([torch.nn.Linear(2, 2)], {"model": 3}, {"version": GlobalRng()}):
            with pytest.raises(UserError, match="parts"):
                store.save(1, parts)
            with pytest.raises(UserError, match="parts"):
                store.load(parts)
    assert not (tmp_path / "store").exists()  # nothing was written


def test_a_single_resume_file_on_a_full_disk_is_a_storage_error(tmp_path):
    script = tmp_path / "full.py"
    script.write_text(
        "import resource, sys, torch\n"
        "from exactresume import StorageError, save_resume\n"
        "save_resume(sys.argv[1], {'model': torch.nn.Linear(2, 2)}, step=1)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))\n"
        "try:\n"
        "    save_resume(sys.argv[1], {'model': torch.nn.Linear(64, 64)}, step=2)\n"
        "except StorageError as error:\n"
        "    print(f'StorageError: {error}')\n"
    )
    finished = run_python(script, tmp_path / "resume.pth")
    line = last_line_with(finished.stdout, "StorageError:")
    assert "EFBIG" in line and "is intact" in line, finished.stdout
    assert torch.load(tmp_path / "resume.pth", weights_only=True)["checkpoint_step"] == 1
    assert not (tmp_path / "resume.pth.tmp").exists()


@pytest.mark.parametrize("step", [-1, -30])
def test_a_negative_step_is_refused_and_nothing_is_written(run, step):
    before = fingerprints(run)
    refused = run_python(PROGRAM, run, "--save-step", step)
    assert refused.returncode == 2 and f"step must be an integer of at least 0, got {step}" in refused.stdout
    assert fingerprints(run) == before


@pytest.mark.parametrize("step", [2.5, "3", True, torch.tensor(1.5)])
def test_a_step_that_is_not_an_integer_is_refused(tmp_path, step):
    with CheckpointStore(tmp_path) as store, pytest.raises(UserError, match="step must be an integer"):
        store.save(step, {"rng": GlobalRng()})
    assert list(tmp_path.iterdir()) == []


def test_keep_means_what_it_means_on_the_command_line(tmp_path):
    kept = run_python(PROGRAM, tmp_path / "all", "--steps", 50, "--keep", 0)  # --keep 0 keeps all
    assert kept.returncode == 0, kept.stdout
    assert [name for name in fingerprints(tmp_path / "all") if name.startswith("step-")] == [
        step_file(step) for step in (10, 20, 30, 40, 50)
    ]
    assert "0: all" in call_cli("train", "--help").stdout.replace("\n", " ")
    refused = run_python(PROGRAM, tmp_path / "negative", "--keep", -1)
    assert refused.returncode == 2 and "keep must be a number of checkpoints" in refused.stdout
    assert not (tmp_path / "negative").exists()


def test_a_damaged_newest_checkpoint_is_set_aside_not_written_over(run, straight):
    newest = run / step_file(30)
    damaged = bytearray(newest.read_bytes())
    damaged[len(damaged) // 2] ^= 0x01
    newest.write_bytes(bytes(damaged))
    resumed = run_python(PROGRAM, run, "--steps", 40)
    assert resumed.returncode == 0, resumed.stdout
    assert "skipping damaged checkpoint" in resumed.stdout and "trained steps 21 to 40" in resumed.stdout
    assert (run / f"{step_file(30)}.unreadable").read_bytes() == bytes(damaged)
    assert f"set aside {newest}" in resumed.stdout
    assert_same_weights(run / "final.pt", straight)


def test_a_folder_whose_every_checkpoint_is_damaged_stops_the_script_rather_than_start_over(run):
    for step in (10, 20, 30):
        checkpoint = run / step_file(step)
        damaged = bytearray(checkpoint.read_bytes())
        damaged[len(damaged) // 2] ^= 0x01
        checkpoint.write_bytes(bytes(damaged))
    before = fingerprints(run)
    refused = run_python(PROGRAM, run, "--steps", 40)
    assert refused.returncode == 2, refused.stdout
    line = last_line_with(refused.stdout, "load refused:")
    for needle in ("none of the 3 checkpoints", step_file(30), "checksum mismatch", "move the checkpoints out"):
        assert needle in line, line
    assert "skipping" not in refused.stdout and "model unchanged: True" in refused.stdout
    # A script that catches the error and trains from step 0 anyway: its first save refuses.
    blind = run_python(PROGRAM, run, "--steps", 40, "--start-over-on-error")
    assert blind.returncode == 2 and "no checkpoint of" in last_line_with(blind.stdout, "CheckpointError:")
    assert fingerprints(run) == before


def test_a_script_started_with_another_seed_is_refused_by_its_identity(tmp_path):
    folder = tmp_path / "run"
    assert run_python(PROGRAM, folder, "--identity", "--steps", 20).returncode == 0
    before = fingerprints(folder)
    other = run_python(PROGRAM, folder, "--identity", "--seed", 1, "--steps", 30)
    assert other.returncode == 2, other.stdout
    line = last_line_with(other.stdout, "load refused:")
    for needle in (step_file(20), "seed: saved 0, given 1", "nothing was loaded", "any_identity=True"):
        assert needle in line, line
    assert "model unchanged: True" in other.stdout and fingerprints(folder) == before
    blind = run_python(PROGRAM, folder, "--identity", "--seed", 1, "--steps", 30, "--start-over-on-error")
    assert blind.returncode == 2 and "not known to be this store's run" in blind.stdout, blind.stdout
    assert fingerprints(folder) == before
    same = run_python(PROGRAM, folder, "--identity", "--steps", 30)
    assert same.returncode == 0 and "trained steps 21 to 30" in same.stdout, same.stdout


def test_diff_and_inspect_read_what_the_store_and_save_resume_wrote(run, tmp_path):
    assert "model unchanged" not in run_python(PROGRAM, run, "--save-step", 31).stdout
    same = call_cli("diff", run / step_file(30), run / step_file(30))
    assert same.returncode == 0 and "equal" in same.stdout and not same.stderr, same.stderr
    differ = call_cli("diff", run / step_file(20), run / step_file(30))
    assert differ.returncode == 1 and "0.weight" in differ.stdout and not differ.stderr, differ.stderr
    shown = call_cli("inspect", run / step_file(30))
    assert shown.returncode == 0 and "step 30" in shown.stdout and "None" not in shown.stdout, shown.stdout
    listing = call_cli("inspect", run)
    assert listing.returncode == 0 and all(step_file(s) in listing.stdout for s in (20, 30, 31)), listing.stdout
    model = torch.nn.Linear(3, 2)
    single = save_resume(tmp_path / "one.pth", {"net": model, "rng": GlobalRng()}, step=7)
    shown = call_cli("inspect", single)
    assert shown.returncode == 0 and "step 7" in shown.stdout, shown.stdout
    differ = call_cli("diff", single, run / step_file(30))
    assert differ.returncode == 2 and "Traceback" not in differ.stderr and len(differ.stderr.splitlines()) == 1
    folders = call_cli("diff", run, run / step_file(31))  # a store's folder: its newest checkpoint
    assert folders.returncode == 0 and "equal" in folders.stdout, folders.stderr
    plain = call_cli("diff", run / "final.pt", run / "final.pt")  # the loop's own torch.save(state_dict())
    assert plain.returncode == 0 and "equal" in plain.stdout, plain.stderr


def test_diff_compares_every_module_part_so_a_missing_ema_is_not_equal(tmp_path):
    model = torch.nn.Linear(4, 2)
    save_resume(tmp_path / "with-ema.pth", {"model": model, "ema": torch.nn.Linear(4, 2)}, step=1)
    save_resume(tmp_path / "without.pth", {"model": model}, step=1)
    differ = call_cli("diff", tmp_path / "with-ema.pth", tmp_path / "without.pth")
    assert differ.returncode == 2 and "names differ" in differ.stderr and "equal" not in differ.stdout, differ.stderr


def test_a_background_store_may_save_its_own_step_again(tmp_path):
    model = torch.nn.Linear(4, 2)
    with CheckpointStore(tmp_path, background=True) as store:
        store.save(3, {"model": model})
        store.wait()
        torch.nn.init.zeros_(model.weight)
        store.save(3, {"model": model})
    assert torch.equal(torch.load(tmp_path / step_file(3), weights_only=True)["model"]["weight"], model.weight)


def test_inspect_and_diff_read_a_sharded_folder_of_the_users_parts(tmp_path):
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    parts = {"net": model, "opt": optimizer, "rng": GlobalRng()}
    save_resume(tmp_path / "sharded", parts, 5, sharded=True)
    with CheckpointStore(tmp_path / "store") as store:
        store.save(5, parts)
    shown = call_cli("inspect", tmp_path / "sharded")
    assert shown.returncode == 0 and "step 5" in shown.stdout.splitlines()[0], shown.stdout + shown.stderr
    assert "checkpoint_step" not in shown.stdout
    same = call_cli("diff", tmp_path / "sharded", tmp_path / "store")
    assert same.returncode == 0 and "2 tensors" in same.stdout, same.stdout + same.stderr


def test_a_load_that_fails_in_a_part_puts_back_the_parts_already_loaded(tmp_path):
    class Refuses:
        def state_dict(self):
            return {"value": 1}

        def load_state_dict(self, state):
            if state != {"value": 1}:  # its own state it takes back; the saved one it refuses
                raise RuntimeError("this part cannot take\nits saved state")

    class Saved(Refuses):
        def state_dict(self):
            return {"value": 2}

    model = torch.nn.Linear(3, 2)
    with CheckpointStore(tmp_path) as store:
        store.save(1, {"model": model, "later": Saved()})
    fresh_model = torch.nn.Linear(3, 2)
    before = fresh_model.weight.detach().clone()
    with CheckpointStore(tmp_path) as store, pytest.raises(CheckpointError) as refused:
        store.load({"model": fresh_model, "later": Refuses()})
    assert torch.equal(fresh_model.weight, before) and not torch.equal(fresh_model.weight, model.weight)
    message = str(refused.value)
    assert "\n" not in message and "the part later could not load" in message and "no part was changed" in message


def test_a_part_that_looks_up_a_key_its_state_lacks_is_told_by_the_key_not_its_bare_text(tmp_path):
    class LooksUp:
        def state_dict(self):
            return {"value": 1}

        def load_state_dict(self, state):
            state["state.blocks.0.step"]  # a key its state lacks: KeyError's text is the key alone

    save_resume(tmp_path / "resume.pth", {"later": LooksUp()}, 1)
    with pytest.raises(CheckpointError) as refused:
        load_resume(tmp_path / "resume.pth", {"later": LooksUp()})
    assert "no key 'state.blocks.0.step' where one was looked up (KeyError)" in str(refused.value), refused.value


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.glob("step-*"))}


def test_a_step_before_a_later_checkpoint_of_the_run_is_refused_and_the_one_it_loaded_still_saves(tmp_path):
    model = torch.nn.Linear(4, 2)
    with CheckpointStore(tmp_path) as store:
        store.save(1, {"model": model}), store.save(2, {"model": model})
    before = folder_bytes(tmp_path)
    with CheckpointStore(tmp_path) as store:
        assert store.load({"model": model}) == 2
        with pytest.raises(CheckpointError) as refused:  # the loop did not keep the step load returned
            store.save(1, {"model": model})
        assert folder_bytes(tmp_path) == before
        store.save(2, {"model": model})  # this store loaded step 2: it is the run's own
    message = str(refused.value)
    assert "\n" not in message and "holds step-00000002.pth, a later step of this run than the 1" in message
    assert "a resume would take it, not this save" in message
    with pytest.raises(CheckpointError, match="already holds step-00000002.pth, a checkpoint this store has not"):
        CheckpointStore(tmp_path).save(2, {"model": model})


def test_a_loop_whose_step_went_back_is_told_before_its_saves_hide_behind_the_old_ones(tmp_path):
    """Saved at 5 after 12, a checkpoint would sit below the run's newest: a resume takes 12, and
    retention, counting up to the step saved, keeps 12 for ever."""
    model = torch.nn.Linear(4, 2)
    with CheckpointStore(tmp_path, keep=2) as store:
        for step in (8, 10, 12):
            store.save(step, {"model": model})
        kept = folder_bytes(tmp_path)
        with pytest.raises(CheckpointError, match="holds step-00000012.pth, a later step of this run than the 5"):
            store.save(5, {"model": model})
        assert folder_bytes(tmp_path) == kept
        store.save(13, {"model": model})  # a later step saves as before
        assert [checkpoint.step for checkpoint in store.checkpoints()] == [12, 13]
        for later in (12, 13):
            (tmp_path / step_file(later)).rename(tmp_path / f"{step_file(later)}.moved")
        store.save(5, {"model": model})  # the later ones moved out: going back is the user's to choose
        assert [checkpoint.step for checkpoint in store.checkpoints()] == [5]
