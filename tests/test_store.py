"""The checkpoint store as a library: save, retention, faults at every stage, skipping damaged files."""

from __future__ import annotations

import json

import pytest
import torch

from exactresume.errors import StorageError, UserError
from exactresume.store.faults import FAULT_ENV, STAGES, Fault
from exactresume.store.folder import CheckpointStore
from exactresume.store.lock import LOCK_NAME
from exactresume.store.numbered import checkpoint_name
from exactresume.store.sealed import save_sealed
from exactresume.training.parts import GeneratorPart, GlobalRng
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
    import exactresume.store.folder as store_module

    parts = make_parts()
    quiet_store(tmp_path).save(1, parts)
    real_verify = store_module.verify

    def verify_after_damage(path):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        real_verify(path)

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


def test_restore_removes_tmp_leftovers(tmp_path):
    (tmp_path / "step-00000004.pth.tmp").write_bytes(b"half a checkpoint")
    store = quiet_store(tmp_path)
    assert store.leftovers() == [tmp_path / "step-00000004.pth.tmp"]
    assert store.load(make_parts()) is None
    assert names(tmp_path) == []


def test_reserved_part_names_are_refused(tmp_path):
    with pytest.raises(UserError, match="reserved"):
        quiet_store(tmp_path).save(1, {"version": GlobalRng()})


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
