"""The checkpoint store as a library: save, retention, faults at every stage, skipping damaged files."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from exactresume.errors import CheckpointError, FieldError, StorageError, UserError
from exactresume.parts import GeneratorPart, GlobalRng
from exactresume.store.faults import FAULT_ENV, STAGES, Fault
from exactresume.store.fit import check_tensors
from exactresume.store.layout import checkpoint_name
from exactresume.store.lock import LOCK_NAME
from exactresume.store.numbered import CheckpointStore
from exactresume.store.sealed import save_sealed
from helpers import call_cli


def make_parts(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return {
        "model": model,
        "optimizer": torch.optim.AdamW(model.parameters(), lr=0.1),
        "data": GeneratorPart(torch.Generator().manual_seed(seed)),
        "rng": GlobalRng(),
    }


def advance(parts: dict) -> None:
    """One training step that uses every part."""
    inputs = torch.randn(2, 4, generator=parts["data"].generator) + torch.rand(1)
    parts["optimizer"].zero_grad()
    parts["model"](inputs).square().sum().backward()
    parts["optimizer"].step()


def quiet_store(folder, keep=3, messages=None) -> CheckpointStore:
    return CheckpointStore(folder, keep=keep, notify=(messages.append if messages is not None else lambda m: None))


def names(folder) -> list[str]:
    """The folder's files, less the lock a live store holds on it."""
    return sorted(p.name for p in folder.iterdir() if p.name != LOCK_NAME)


def test_restore_continues_exactly(tmp_path):
    straight = make_parts()
    for _ in range(6):
        advance(straight)

    first = make_parts()
    store = quiet_store(tmp_path)
    for _step in range(1, 4):
        advance(first)
    assert store.save(3, first) == tmp_path / checkpoint_name(3)
    advance(first)  # progress after the checkpoint is lost in the "crash"
    store.close()  # the crashed writer's lock is gone

    second = make_parts(seed=99)  # a different start, overwritten by the restore
    assert quiet_store(tmp_path).load(second) == 3
    for _ in range(3):
        advance(second)
    for name, tensor in straight["model"].state_dict().items():
        assert torch.equal(tensor, second["model"].state_dict()[name]), name


def test_loading_an_empty_or_missing_folder_gives_none(tmp_path):
    assert quiet_store(tmp_path / "nothing").load(make_parts()) is None
    assert quiet_store(tmp_path).load(make_parts()) is None


def test_retention_keeps_newest_and_only_after_the_new_one_is_verified(tmp_path):
    store, parts = quiet_store(tmp_path, keep=2), make_parts()
    for step in (10, 20, 30, 40):
        store.save(step, parts)
    assert names(tmp_path) == [checkpoint_name(30), checkpoint_name(40)]
    assert [c.step for c in store.checkpoints()] == [30, 40]
    store.close()  # one writer per folder: the next store writes once this one is done
    keep_all = quiet_store(tmp_path, keep=None)
    keep_all.save(50, parts)
    assert len(keep_all.checkpoints()) == 3


@pytest.mark.parametrize("stage", ["snapshot", "write", "fsync", "rename", "folder-fsync", "verify"])
@pytest.mark.parametrize("action", ["enospc", "eio"])
def test_failed_save_leaves_previous_checkpoint_and_no_partial_file(tmp_path, monkeypatch, stage, action):
    parts = make_parts()
    quiet_store(tmp_path, keep=1).save(1, parts)
    before = (tmp_path / checkpoint_name(1)).read_bytes()
    advance(parts)
    monkeypatch.setenv(FAULT_ENV, f"{stage}:{action}")
    failing = quiet_store(tmp_path, keep=1)
    with pytest.raises(StorageError) as failure:
        failing.save(2, parts)
    failing.close()  # the failed writer stops; the next one may restore
    assert failure.value.errno == (28 if action == "enospc" else 5)
    assert "\n" not in str(failure.value) and f"{checkpoint_name(1)} is intact" in str(failure.value)
    assert names(tmp_path) == [checkpoint_name(1)]  # no .tmp, no new file, the old one not pruned
    assert (tmp_path / checkpoint_name(1)).read_bytes() == before
    monkeypatch.delenv(FAULT_ENV)
    assert quiet_store(tmp_path).load(make_parts()) == 1


def test_failed_retention_only_warns(tmp_path, monkeypatch):
    messages, parts = [], make_parts()
    quiet_store(tmp_path, keep=1).save(1, parts)
    monkeypatch.setenv(FAULT_ENV, "retention:eio")
    assert quiet_store(tmp_path, keep=1, messages=messages).save(2, parts) == tmp_path / checkpoint_name(2)
    assert names(tmp_path) == [checkpoint_name(1), checkpoint_name(2)]
    assert "could not delete old checkpoints" in messages[0]


def test_a_checkpoint_that_reads_back_damaged_is_removed(tmp_path, monkeypatch):
    import exactresume.store.disk as store_module

    parts = make_parts()
    quiet_store(tmp_path).save(1, parts)
    real_verify = store_module.verify

    def verify_after_damage(path, *written):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        real_verify(path, *written)

    monkeypatch.setattr(store_module, "verify", verify_after_damage)
    with pytest.raises(StorageError, match="read back damaged"):
        quiet_store(tmp_path).save(2, parts)
    assert names(tmp_path) == [checkpoint_name(1)]


@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty", "foreign", "renamed"])
def test_restore_skips_a_damaged_newest_checkpoint_and_says_so(tmp_path, damage):
    parts = make_parts()
    store = quiet_store(tmp_path, keep=None)
    store.save(1, parts)
    advance(parts)
    store.save(2, parts)
    store.close()  # the writer is done; the damage comes from outside
    newest = tmp_path / checkpoint_name(2)
    data = newest.read_bytes()
    if damage == "truncated":
        newest.write_bytes(data[: len(data) // 3])
    elif damage == "flipped":
        newest.write_bytes(data[:200] + bytes([data[200] ^ 1]) + data[201:])
    elif damage == "empty":
        newest.write_bytes(b"")
    elif damage == "foreign":
        save_sealed(newest, {"weight": torch.ones(3)})
    elif damage == "renamed":  # a file whose name does not match the step it holds
        (tmp_path / checkpoint_name(1)).rename(tmp_path / checkpoint_name(7))
        newest = tmp_path / checkpoint_name(7)
    messages = []
    restored = make_parts(seed=5)
    step = quiet_store(tmp_path, messages=messages).load(restored)
    assert step == (2 if damage == "renamed" else 1)
    assert len(messages) == 1 and str(newest) in messages[0] and "skipping" in messages[0]
    # "damaged" is said of bytes that fail verification only
    said = messages[0].replace(str(tmp_path), "FOLDER")  # the test's own folder is named "...damaged..."
    assert ("damaged" in said) == (damage in ("truncated", "flipped", "empty")), said


def damage(path, how: str) -> None:
    """`path` damaged `how`: bits flipped, cut short, emptied, or replaced by a sealed file that is not ours."""
    data = path.read_bytes()
    if how == "flipped":
        path.write_bytes(data[:200] + bytes([data[200] ^ 1]) + data[201:])
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 3])
    elif how == "empty":
        path.write_bytes(b"")
    else:
        save_sealed(path, {"weight": torch.ones(3)})


def test_a_folder_whose_every_checkpoint_is_damaged_is_refused_not_started_fresh(tmp_path):
    parts = make_parts()
    with quiet_store(tmp_path, keep=None) as store:
        for step in (10, 20, 30, 40):
            advance(parts)
            store.save(step, parts)
    for step, how in zip((40, 30, 20, 10), ("flipped", "truncated", "empty", "foreign")):
        damage(tmp_path / checkpoint_name(step), how)
    before = {name: (tmp_path / name).read_bytes() for name in names(tmp_path)}
    messages, restored = [], make_parts(seed=5)
    untouched = {name: tensor.clone() for name, tensor in restored["model"].state_dict().items()}
    store = quiet_store(tmp_path, messages=messages)
    with pytest.raises(CheckpointError) as refused:
        store.load(restored)
    line = str(refused.value)
    assert "\n" not in line and messages == []  # one line, not a notice per checkpoint first
    for needle in ("none of the 4 checkpoints", str(tmp_path), checkpoint_name(40), "and 1 more", "checksum mismatch"):
        assert needle in line, line
    assert "move the checkpoints out of the folder" in line, line
    assert all(torch.equal(t, untouched[n]) for n, t in restored["model"].state_dict().items())
    # A loop that catches the error and trains from step 0 anyway writes nothing beside them.
    with pytest.raises(CheckpointError, match="no checkpoint of .* could be loaded"):
        store.save(10, restored)
    store.close()
    assert {name: (tmp_path / name).read_bytes() for name in names(tmp_path)} == before
    # The way out the line names: moved away, the folder is empty, and a fresh start is on purpose.
    (tmp_path / "damaged").mkdir()
    for name in before:
        (tmp_path / name).rename(tmp_path / "damaged" / name)
    with quiet_store(tmp_path) as store:
        assert store.load(restored) is None
        assert store.save(10, restored) == tmp_path / checkpoint_name(10)


def test_the_only_checkpoint_damaged_is_refused_by_a_sharded_store_too(tmp_path):
    parts = {"model": make_parts()["model"]}
    with CheckpointStore(tmp_path, sharded=True) as store:
        store.save(3, parts)
    shard = next((tmp_path / "step-00000003.dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    with CheckpointStore(tmp_path, sharded=True, notify=lambda m: None) as store:
        with pytest.raises(CheckpointError, match="the only checkpoint in .* cannot be loaded .*step-00000003.dcp"):
            store.load(parts)


def test_a_prefix_whose_every_checkpoint_is_damaged_is_refused(moto_s3):
    from exactresume.store.locations import S3Config

    moto_s3.create_bucket(Bucket="damaged")
    parts = {"model": make_parts()["model"]}
    with CheckpointStore("s3://damaged/run", keep=None, config=S3Config()) as store:
        for step in (1, 2):
            store.save(step, parts)
    for step in (1, 2):
        key = f"run/{checkpoint_name(step)}"
        data = moto_s3.get_object(Bucket="damaged", Key=key)["Body"].read()
        moto_s3.put_object(Bucket="damaged", Key=key, Body=data[:-100])
    with CheckpointStore("s3://damaged/run", config=S3Config(), notify=lambda m: None) as store:
        with pytest.raises(CheckpointError, match="none of the 2 checkpoints in s3://damaged/run can be loaded"):
            store.load(parts)


def test_restore_removes_tmp_leftovers(tmp_path):
    (tmp_path / "step-00000004.pth.tmp").write_bytes(b"half a checkpoint")
    store = quiet_store(tmp_path)
    assert store.leftovers() == [tmp_path / "step-00000004.pth.tmp"]
    assert store.load(make_parts()) is None
    assert names(tmp_path) == []


def test_reserved_part_names_are_refused(tmp_path):
    with pytest.raises(UserError, match="reserved"):
        quiet_store(tmp_path).save(1, {"version": GlobalRng()})
    with pytest.raises(UserError, match="reserved"):
        quiet_store(tmp_path).save(1, {"identity": GlobalRng()})  # a store's identity= is kept under it


def test_a_part_skip_names_that_is_nowhere_is_a_misspelling_said_and_nothing_is_loaded(tmp_path):
    quiet_store(tmp_path).save(1, make_parts())
    target = make_parts(seed=5)
    with pytest.raises(UserError, match="skip= names parts neither given nor in .*step-00000001.pth: optimiser$"):
        quiet_store(tmp_path).load(target, skip=["optimiser"])
    assert torch.equal(target["model"].weight, make_parts(seed=5)["model"].weight)
    assert quiet_store(tmp_path).load(target, skip=["optimizer"]) == 1  # given: left as it is


def test_another_kind_of_optimizers_state_is_refused_before_torch_loads_it_and_fails_at_the_step(tmp_path):
    quiet_store(tmp_path).save(1, make_parts())
    saved = torch.load(tmp_path / checkpoint_name(1), weights_only=True)["optimizer"]
    # By hand: torch takes AdamW's state into SGD without a word, and its first step raises a KeyError.
    by_hand = make_parts(seed=5)
    by_hand["optimizer"] = torch.optim.SGD(by_hand["model"].parameters(), lr=0.1, momentum=0.9)
    by_hand["optimizer"].load_state_dict(saved)
    with pytest.raises(KeyError, match="momentum"):
        advance(by_hand)
    target = make_parts(seed=5)
    target["optimizer"] = torch.optim.SGD(target["model"].parameters(), lr=0.1, momentum=0.9)
    with quiet_store(tmp_path) as store, pytest.raises(CheckpointError) as refused:
        store.load(target)
    line = str(refused.value)
    for needle in ("the part optimizer does not fit", "lack dampening, momentum, which SGD steps with", "betas"):
        assert needle in line, line
    assert line.endswith("nothing was loaded; skip=['optimizer'] loads the rest and starts optimizer fresh"), line
    assert torch.equal(target["model"].weight, make_parts(seed=5)["model"].weight)
    assert target["optimizer"].param_groups[0]["momentum"] == 0.9
    assert quiet_store(tmp_path).load(target, skip=["optimizer"]) == 1
    advance(target)  # SGD steps with its own hyperparameters
    # Adam's state in an AdamW, and AdamW's of an older torch (without the newer keys): torch fills them in.
    older = {
        **saved,
        "param_groups": [{k: v for k, v in g.items() if k != "decoupled_weight_decay"} for g in saved["param_groups"]],
    }
    for optimizer in (torch.optim.Adam, torch.optim.AdamW):
        again = make_parts(seed=5)
        again["optimizer"] = optimizer(again["model"].parameters())
        check_tensors("optimizer", older, again["optimizer"], "older")


@pytest.mark.parametrize(
    "call",
    ["save_resume", "load_resume", "open_resume", "store.save", "store.load", "sharded.save", "sharded.load"],
)
def test_every_public_call_names_a_part_without_state_dict_alike(tmp_path, call):
    """Parts are checked where they enter, once, with one line, whichever call they enter by."""
    from exactresume import load_resume, open_resume, save_resume

    good, bad = make_parts(), {"model": torch.nn.Linear(2, 2), "data": object()}
    save_resume(tmp_path / "resume.pth", good, step=1)
    calls = {
        "save_resume": lambda: save_resume(tmp_path / "other.pth", bad, step=1),
        "load_resume": lambda: load_resume(tmp_path / "resume.pth", bad),
        "open_resume": lambda: open_resume(tmp_path / "resume.pth").restore(bad),
        "store.save": lambda: quiet_store(tmp_path / "store").save(1, bad),
        "store.load": lambda: quiet_store(tmp_path / "store").load(bad),
        "sharded.save": lambda: CheckpointStore(tmp_path / "sharded", sharded=True).save(1, bad),
        "sharded.load": lambda: CheckpointStore(tmp_path / "sharded", sharded=True).load(bad),
    }
    with pytest.raises(FieldError, match=r"^parts: data \(object\) has no state_dict\(\) / load_state_dict\(\)$"):
        calls[call]()


def test_save_resume_to_no_file_or_to_a_folder_is_a_users_mistake_in_one_line(tmp_path, monkeypatch):
    """An empty path raised a bare ValueError, and a folder a StorageError (exit 74, a disk's failure)."""
    from exactresume import save_resume

    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "mine.txt").write_text("kept")
    for path, said in (("", "'' names no file"), ("folder", "folder is a folder: give a file's path in it")):
        with pytest.raises(UserError, match=said) as refused:
            save_resume(path, make_parts(), step=1)
        assert type(refused.value) is UserError and "\n" not in str(refused.value)
    assert [p.name for p in tmp_path.iterdir()] == ["folder"]
    assert (tmp_path / "folder" / "mine.txt").read_text() == "kept"


def test_a_save_refused_for_a_checkpoint_it_has_not_loaded_is_refused_until_that_one_is_moved_away(tmp_path):
    parts = make_parts()
    with quiet_store(tmp_path) as first:
        for step in (1, 2):
            first.save(step, parts)
    second = quiet_store(tmp_path)  # a loop that forgot to load
    for step in (1, 5):  # over the run's own, and past it: that would prune it
        with pytest.raises(CheckpointError, match="already holds step-00000001.pth, a checkpoint this store has not"):
            second.save(step, parts)
    aside = tmp_path / "aside"
    aside.mkdir()
    for step in (1, 2):
        (tmp_path / checkpoint_name(step)).rename(aside / checkpoint_name(step))
    assert second.save(1, parts) == tmp_path / checkpoint_name(1)
    second.close()


def test_fault_specs_parse_and_refuse_nonsense():
    assert Fault.parse("rename") == Fault("rename", 1, "kill")
    assert Fault.parse("write@3:enospc") == Fault("write", 3, "enospc")
    assert set(STAGES) >= {"write", "fsync", "rename", "folder-fsync", "retention"}
    for bad in ("nowhere", "write@x", "write:explode", "write@0"):
        with pytest.raises(UserError, match=FAULT_ENV):
            Fault.parse(bad)


def test_a_plain_torch_load_of_a_users_checkpoint_shows_their_part_names(tmp_path):
    parts = make_parts()
    advance(parts)
    with quiet_store(tmp_path) as store:
        newest = store.save(1, parts)
    state = torch.load(newest, weights_only=True)
    assert {"model", "optimizer", "data", "rng"} <= state.keys()
    assert state["model"].keys() == parts["model"].state_dict().keys()
    assert all(torch.equal(state["model"][k], v) for k, v in parts["model"].state_dict().items())
    expected = parts["optimizer"].state_dict()
    assert state["optimizer"]["param_groups"] == expected["param_groups"]
    for index, moments in expected["state"].items():
        assert all(torch.equal(state["optimizer"]["state"][index][k], v) for k, v in moments.items())
    assert torch.equal(state["data"], parts["data"].generator.get_state())


def test_open_resume_and_inspect_read_any_store_folder(tmp_path):
    from exactresume.store.access import open_resume

    parts = make_parts()
    with quiet_store(tmp_path) as store:
        for step in (1, 2):
            advance(parts)
            store.save(step, parts)
    newest = tmp_path / checkpoint_name(2)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 1
    newest.write_bytes(bytes(data))  # the newest is damaged: the one before is used
    skipped = []
    resumed = open_resume(tmp_path, notify=skipped.append)
    assert (resumed.step, resumed.kind) == (1, "store") and {
        "model",
        "optimizer",
        "data",
        "rng",
    } <= resumed.state.keys()
    assert len(skipped) == 1 and "checksum mismatch" in skipped[0]
    finished = call_cli("inspect", tmp_path, "--json")
    assert finished.returncode == 1, finished.stderr  # listed, with a damaged checkpoint among them
    info = json.loads(finished.stdout)
    assert info["kind"] == "store" and info["newest_valid_step"] == 1
    assert [c["status"] for c in info["checkpoints"]] == ["verified", "damaged"]
    assert set(info["checkpoints"][0]["parts"]) == {"model", "optimizer", "data", "rng"}
    assert "a resume continues from step 1" in call_cli("inspect", tmp_path).stdout


def test_inspect_lists_the_checkpoints_a_save_set_aside(tmp_path):
    parts = make_parts()
    with quiet_store(tmp_path, keep=None) as store:
        store.save(1, parts)
        store.save(2, parts)
    damaged = tmp_path / checkpoint_name(2)
    damaged.write_bytes(damaged.read_bytes()[:-5])
    with quiet_store(tmp_path, keep=None) as store:
        assert store.load(parts) == 1
        store.save(2, parts)  # the damaged file at its step is renamed, not written over
    aside = tmp_path / f"{checkpoint_name(2)}.unreadable"
    assert aside.exists()
    finished = call_cli("inspect", tmp_path, "--json")
    assert finished.returncode == 0, finished.stderr  # both checkpoints verify; what was set aside is no checkpoint
    assert json.loads(finished.stdout)["set_aside"] == [str(aside)]
    listing = call_cli("inspect", tmp_path).stdout
    assert "1 set aside as damaged" in listing.splitlines()[0]
    assert f"  {aside.name}  set aside: damaged" in listing and "never read" in listing


def test_an_empty_folder_path_is_refused_rather_than_the_current_folder_used(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FieldError, match="^folder must be a folder's path, got an empty one$"):
        CheckpointStore("")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("under", ["checkpoints", "runs/checkpoints"])
def test_a_folder_under_a_file_is_refused_at_once_naming_the_file(tmp_path, under):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file, not a folder")
    with pytest.raises(UserError) as refused:
        CheckpointStore(blocker / under)  # not an empty folder that loads as a fresh start, then fails to save
    assert str(refused.value) == (
        f"{blocker / under} cannot be a folder of checkpoints: {blocker} is a file, not a folder"
    )


def read_only(monkeypatch, folder: Path, code: int) -> None:
    """`folder` as a read-only one: every open in it that writes or creates fails with `code`. Tests run as
    root here, whom chmod does not stop, so the refusal is made where the store meets the system."""
    real_open = os.open

    def open_reading_only(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and Path(path).resolve().is_relative_to(folder):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_reading_only)


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS], ids=["EACCES", "EROFS"])
def test_a_read_only_folder_is_read_and_each_refusal_gives_the_advice_that_fits(tmp_path, monkeypatch, code):
    parts = make_parts()
    with quiet_store(tmp_path) as store:
        store.save(1, parts)
    read_only(monkeypatch, tmp_path.resolve(), code)
    reason = f"{os.strerror(code)} ({errno.errorcode[code]})"
    with pytest.raises(StorageError) as cleaning:
        quiet_store(tmp_path).load(make_parts())
    assert str(cleaning.value) == (
        f"could not write the lock file of {tmp_path}: {reason}; {tmp_path} is not writable, and a reader, "
        "which writes nothing there, loads with store.load(parts, clean=False)"
    )
    reader = quiet_store(tmp_path)
    assert reader.load(make_parts(), clean=False) == 1  # as the advice says
    with pytest.raises(StorageError) as saving:
        reader.save(2, parts)
    assert str(saving.value) == (
        f"could not write the checkpoint at step 2 in {tmp_path}: {reason}; {tmp_path / checkpoint_name(1)} is "
        f"intact; {tmp_path} is not writable, so no checkpoint can be saved there: give the store a writable folder"
    )
    assert names(tmp_path) == [checkpoint_name(1)]


def test_a_store_that_never_loaded_keeps_the_older_checkpoints_it_did_not_write(tmp_path):
    """A loop that forgot to load and saves past an earlier run's checkpoints continues beside them, and its
    retention prunes only what it wrote: the earlier run's are never lost to the mistake."""
    parts = make_parts()
    with quiet_store(tmp_path, keep=2) as earlier:
        for step in (1, 2, 3):
            earlier.save(step, parts)
    theirs = {name: (tmp_path / name).read_bytes() for name in names(tmp_path)}  # steps 2 and 3
    with quiet_store(tmp_path, keep=2) as forgot_to_load:
        for step in (4, 5, 6):
            forgot_to_load.save(step, parts)
    assert names(tmp_path) == [checkpoint_name(n) for n in (2, 3, 5, 6)]
    assert {name: (tmp_path / name).read_bytes() for name in theirs} == theirs
    with quiet_store(tmp_path, keep=2) as resumed:  # a store that loads takes the whole folder as its run's
        assert resumed.load(make_parts(1)) == 6
        resumed.save(7, parts)
    assert names(tmp_path) == [checkpoint_name(n) for n in (6, 7)]
