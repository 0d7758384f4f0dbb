"""A key (`EXACTRESUME_KEY`, or `key=`) makes checkpoints tamper-evident (store/seal_hash.py): every seal,
shard checksum and commit is an HMAC of the bytes, and a file that an attacker re-sealed without the key,
whose seal was stripped, or that another key sealed is refused in one line before a byte is unpickled.
Without a key files are as before, and with one a plain torch.load still reads every file."""

from __future__ import annotations

import hashlib
import hmac
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
import xxhash

from exactresume import (
    CheckpointError,
    CheckpointStore,
    StorageError,
    UserError,
    load_resume,
    open_resume,
    read_resume,
    save_resume,
)
from exactresume.integrations.seal import opened, sealed
from exactresume.store import disk
from exactresume.store.layout import checkpoint_name
from exactresume.store.seal_hash import KEY_VARIABLE, Sealing, keyed
from exactresume.store.sealed import SEAL_LENGTH, save_sealed
from helpers import assert_one_line_error, assert_weights_equal, call_cli, train_cli

KEY, OTHER_KEY = "a-secret-of-32-characters-long!!", "another-secret-32-characters-ok!"


def parts(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters())}


def weights(loaded: dict) -> dict:
    return {name: tensor.clone() for name, tensor in loaded["model"].state_dict().items()}


def resealed_without_the_key(path: Path) -> None:
    """What an attacker who can write the file does: change a weight, and seal it again as exactresume
    does without a key (the xxh3 recomputed)."""
    state = torch.load(path, weights_only=True)
    state["model"]["weight"] += 1
    with keyed(Sealing()):
        save_sealed(path, state)


def stripped(path: Path) -> None:
    """The seal cut off: the bytes torch.save wrote, their zip comment empty again."""
    data = path.read_bytes()
    path.write_bytes(data[: -SEAL_LENGTH - 2] + struct.pack("<H", 0))


def sealed_with_another_key(path: Path) -> None:
    state = torch.load(path, weights_only=True)
    with keyed(Sealing(OTHER_KEY.encode())):
        save_sealed(path, state)


def piece_mac(key: str, data: bytes) -> str:
    """The keyed seal as docs/library.md defines it, computed here from hashlib alone: HMAC-SHA-256 over a
    tag, the length and the SHA-256 of every 8 MiB piece, cut to 128 bits."""
    piece = 8 << 20
    leaves = b"".join(hashlib.sha256(data[at : at + piece]).digest() for at in range(0, len(data), piece))
    message = b"exactresume-mac-1" + struct.pack("<Q", len(data)) + leaves
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()[:32]


@pytest.mark.parametrize("size", [1, 3_000_000])  # one piece; five pieces, hashed on every core
def test_a_keyed_file_is_a_plain_torch_file_whose_seal_is_the_mac_of_its_bytes(tmp_path, size):
    path = save_resume(tmp_path / "resume.pth", {"big": torch.nn.Linear(size, 3)}, step=3, key=KEY)
    assert torch.load(path, weights_only=True)["checkpoint_step"] == 3  # nothing of ours needed to read it
    data = path.read_bytes()
    seal = data[-SEAL_LENGTH:]
    assert seal.startswith(b"exactresume-hmac-128:")
    written = data[: -SEAL_LENGTH - 2] + b"\0\0"  # what torch.save wrote: the seal covers it, comment length 0
    assert seal.endswith(piece_mac(KEY, written).encode())
    assert xxhash.xxh3_128_hexdigest(written).encode() not in data  # not the unkeyed seal
    assert load_resume(path, {"big": torch.nn.Linear(size, 3)}, key=KEY) == 3


@pytest.mark.parametrize(
    "attack, line",
    [
        (resealed_without_the_key, "sealed without a key, while a key is set"),
        (stripped, "no exactresume checksum at the end of the file"),
        (sealed_with_another_key, "its keyed seal does not match: written with another key, or modified"),
    ],
)
def test_a_tampered_file_is_refused_in_one_line_and_nothing_is_loaded(tmp_path, attack, line):
    path = save_resume(tmp_path / "resume.pth", parts(), step=3, key=KEY)
    attack(path)
    target = parts(seed=1)
    before = weights(target)
    with pytest.raises(CheckpointError) as refused:
        load_resume(path, target, key=KEY)
    assert line in str(refused.value) and "\n" not in str(refused.value) and str(path) in str(refused.value)
    assert all(torch.equal(before[name], tensor) for name, tensor in weights(target).items())


def test_each_side_refuses_the_other(tmp_path, monkeypatch):
    keyed_file = save_resume(tmp_path / "keyed.pth", parts(), step=1, key=KEY)
    plain_file = save_resume(tmp_path / "plain.pth", parts(), step=1)
    with pytest.raises(CheckpointError, match="sealed with a key, and no key is set"):
        load_resume(keyed_file, parts())
    with pytest.raises(CheckpointError, match="sealed without a key, while a key is set"):
        load_resume(plain_file, parts(), key=KEY)
    monkeypatch.setenv(KEY_VARIABLE, KEY)  # the environment's key, as the trainer and `inspect` take it
    assert load_resume(keyed_file, parts()) == 1
    with pytest.raises(CheckpointError, match="sealed without a key"):
        load_resume(plain_file, parts())


def test_a_store_passes_over_a_tampered_newest_checkpoint_to_the_newest_that_verifies(tmp_path):
    said: list[str] = []
    with CheckpointStore(tmp_path, key=KEY, notify=said.append) as store:
        for step in (1, 2, 3):
            store.save(step, parts(step))
    resealed_without_the_key(tmp_path / checkpoint_name(3))
    target = parts(seed=9)
    with CheckpointStore(tmp_path, key=KEY, notify=said.append) as store:
        assert store.load(target) == 2
    assert all(torch.equal(target["model"].state_dict()[k], v) for k, v in weights(parts(2)).items())
    assert len(said) == 1 and checkpoint_name(3) in said[0] and "sealed without a key" in said[0], said
    assert "damaged" not in said[0]  # not known to be: sealed otherwise than the key in force verifies
    with pytest.raises(CheckpointError, match="none of the 3 checkpoints") as refused:
        CheckpointStore(tmp_path, key=OTHER_KEY).load(parts())
    assert str(refused.value).endswith("set the key they were written with (unset it where sealed without a key)")


def test_a_sharded_checkpoints_marker_resealed_without_the_key_is_refused(tmp_path):
    with CheckpointStore(tmp_path, key=KEY, sharded=True) as store:
        store.save(1, parts(1))
    folder = tmp_path / "step-00000001.dcp"
    shard = next(folder.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    marker = torch.load(folder / "commit.pth", weights_only=True)
    marker["files"][shard.name] = xxhash.xxh3_128_hexdigest(bytes(data))  # the attacker's new checksum
    with keyed(Sealing()):
        save_sealed(folder / "commit.pth", marker)
    with pytest.raises(CheckpointError, match=r"commit.pth: sealed without a key"):
        CheckpointStore(tmp_path, key=KEY, sharded=True).load(parts())


def test_keyed_stores_on_an_object_store_one_file_streamed_and_sharded(moto_s3, tmp_path):
    moto_s3.create_bucket(Bucket="keyed")
    big = {"weights": torch.nn.Linear(600, 600)}  # over 1 MB: loaded as it streams in (s3/stream.py)
    for prefix, options, state in (("one", {}, big), ("sharded", {"sharded": True}, parts(4))):
        with CheckpointStore(f"s3://keyed/{prefix}", key=KEY, **options) as store:
            store.save(1, state)
        with CheckpointStore(f"s3://keyed/{prefix}", key=KEY, **options) as store:
            assert store.load(state) == 1
        with pytest.raises(CheckpointError, match="sealed with a key, and no key is set"):
            CheckpointStore(f"s3://keyed/{prefix}", **options).load(state, clean=False)
    # the attacker's checkpoint, saved without the key, copied over the keyed one with its commit
    with CheckpointStore("s3://keyed/attacker") as store:
        store.save(1, {"weights": torch.nn.Linear(600, 600)})
    for end in ("", ".commit"):
        name = checkpoint_name(1) + end
        moto_s3.copy_object(
            Bucket="keyed", Key=f"one/{name}", CopySource={"Bucket": "keyed", "Key": f"attacker/{name}"}
        )
    with pytest.raises(CheckpointError, match="sealed without a key, while a key is set"):
        CheckpointStore("s3://keyed/one", key=KEY).load(big, clean=False)


@pytest.mark.parametrize("sharded", [False, True], ids=["one file", "sharded"])
def test_a_forged_checkpoint_on_an_object_store_is_copied_aside_before_its_step_is_committed_anew(moto_s3, sharded):
    """As on a disk: the load passes over a checkpoint it cannot verify, and the save at its step keeps it
    as NAME.unreadable (a server-side copy: a prefix has no rename) rather than write over it."""
    moto_s3.create_bucket(Bucket="keyed")
    options = {"sharded": sharded}
    for prefix, key in (("run", KEY), ("attacker", None)):
        with CheckpointStore(f"s3://keyed/{prefix}", key=key, keep=None, **options) as store:
            for step in (1, 2):
                store.save(step, parts(step if prefix == "run" else 9))
    name = checkpoint_name(2).replace(".pth", ".dcp") if sharded else checkpoint_name(2)

    def objects(prefix: str) -> dict[str, bytes]:
        listed = moto_s3.list_objects_v2(Bucket="keyed", Prefix=prefix).get("Contents", [])
        read = lambda key: moto_s3.get_object(Bucket="keyed", Key=key)["Body"].read()
        return {entry["Key"][len(prefix) :]: read(entry["Key"]) for entry in listed}

    planted = objects(f"attacker/{name}")  # the attacker's step 2, with its commit, over the run's
    for below in planted:
        source = {"Bucket": "keyed", "Key": f"attacker/{name}{below}"}
        moto_s3.copy_object(Bucket="keyed", Key=f"run/{name}{below}", CopySource=source)
    said = []
    with CheckpointStore("s3://keyed/run", key=KEY, keep=None, notify=said.append, **options) as store:
        loaded = parts()
        assert store.load(loaded) == 1
        store.save(2, loaded)
        assert [str(path) for path in store.set_aside()] == [f"s3://keyed/run/{name}.unreadable"]
    assert objects(f"run/{name}.unreadable") == planted  # kept byte for byte with its commit, never read
    assert any(f"set aside s3://keyed/run/{name} as {name}.unreadable" in line for line in said), said
    with CheckpointStore("s3://keyed/run", key=KEY, **options) as store:
        assert store.load(parts()) == 2


def test_a_key_too_short_or_not_a_string_is_one_line(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="key is 6 bytes long: a key is at least 16"):
        CheckpointStore(tmp_path, key="secret")
    with pytest.raises(UserError, match="key must be a str or bytes, got an int"):
        save_resume(tmp_path / "a.pth", parts(), key=1234)
    monkeypatch.setenv(KEY_VARIABLE, "short")
    with pytest.raises(UserError, match="EXACTRESUME_KEY is 5 bytes long"):
        CheckpointStore(tmp_path)
    assert not any(tmp_path.iterdir())  # refused before anything was written


FLAGS = ["--steps", "8", "--batch", "4", "--seq-len", "16", "--save-every", "2", "--preset", "tiny"]


def test_the_trainer_with_a_key_resumes_bit_identical_and_refuses_what_another_key_or_none_wrote(tmp_path, kjv_folder):
    key = {KEY_VARIABLE: KEY}
    straight, run, plain = tmp_path / "straight", tmp_path / "run", tmp_path / "plain"
    train_cli(straight, "--data", kjv_folder, *FLAGS, check=True, env=key)
    train_cli(run, "--data", kjv_folder, *FLAGS, "--stop-at", 4, check=True, env=key)
    newest = run / "checkpoints" / checkpoint_name(4)
    kept = newest.read_bytes()
    for env, needle in (({}, "sealed with a key, and no key is set"), ({KEY_VARIABLE: OTHER_KEY}, "another key")):
        refused = train_cli(run, "--data", kjv_folder, *FLAGS, "--resume", "auto", env=env)
        assert_one_line_error(refused, needle)
        assert newest.read_bytes() == kept  # nothing written over, nothing set aside
    log = (run / "log.csv").read_bytes()
    started_over = train_cli(run, "--data", kjv_folder, *FLAGS, "--overwrite", env={KEY_VARIABLE: OTHER_KEY})  # fresh
    assert_one_line_error(started_over, f"holds {checkpoint_name(2)}, which this store cannot verify", "another key")
    assert newest.read_bytes() == kept and (run / "log.csv").read_bytes() == log  # refused before a row is cut
    train_cli(run, "--data", kjv_folder, *FLAGS, "--resume", "auto", check=True, env=key)
    with keyed(Sealing(KEY.encode())):
        assert_weights_equal(straight / "final.pth", run / "final.pth")
    assert (run / "log.csv").read_bytes() == (straight / "log.csv").read_bytes()
    # a key given to a run whose checkpoints were written without one
    train_cli(plain, "--data", kjv_folder, *FLAGS, "--stop-at", 4, check=True)
    before = {path.name: path.read_bytes() for path in (plain / "checkpoints").iterdir()}
    refused = train_cli(plain, "--data", kjv_folder, *FLAGS, "--resume", "auto", env=key)
    assert_one_line_error(refused, "sealed without a key, while a key is set")
    assert {path.name: path.read_bytes() for path in (plain / "checkpoints").iterdir()} == before
    log = (plain / "log.csv").read_bytes()
    # no key, no --resume: the checkpoints are not a fresh run's to write over, even one told to --overwrite
    started_over = train_cli(plain, "--data", kjv_folder, *FLAGS, "--overwrite")
    assert_one_line_error(started_over, f"already holds {checkpoint_name(2)}, a checkpoint this store has not loaded")
    assert (plain / "log.csv").read_bytes() == log
    shutil.rmtree(plain)


def a_weight_changed_and_resealed_without_the_key(path: Path) -> None:
    state = torch.load(path, weights_only=True)
    next(iter(state["model"].values())).add_(1)
    with keyed(Sealing()):
        save_sealed(path, state)


@pytest.mark.parametrize("forge", [sealed_with_another_key, a_weight_changed_and_resealed_without_the_key])
def test_a_forged_checkpoint_planted_ahead_of_a_keyed_run_is_passed_over_and_set_aside_not_a_stop(
    tmp_path, kjv_folder, forge
):
    """One file planted in the folder must not stop every restart of a keyed run: its resume passes over
    it, as a store's load does, and its save at that step sets it aside."""
    key = {KEY_VARIABLE: KEY}
    straight, run = tmp_path / "straight", tmp_path / "run"
    train_cli(straight, "--data", kjv_folder, *FLAGS, check=True, env=key)
    train_cli(run, "--data", kjv_folder, *FLAGS, "--stop-at", 4, check=True, env=key)
    planted = run / "checkpoints" / checkpoint_name(6)
    shutil.copyfile(run / "checkpoints" / checkpoint_name(4), planted)
    forge(planted)
    forged = planted.read_bytes()
    beyond = run / "checkpoints" / checkpoint_name(20)  # and one past the run's end, never reached
    beyond.write_bytes(forged)
    resumed = train_cli(run, "--data", kjv_folder, *FLAGS, "--resume", "auto", check=True, env=key)
    assert f"skipping checkpoint {planted}" in resumed.stderr + resumed.stdout
    newest = next(line for line in resumed.stdout.splitlines() if line.startswith("newest checkpoint"))
    assert checkpoint_name(8) in newest and "3 kept" in newest, newest  # the run's own, not the planted one
    assert (run / "checkpoints" / f"{checkpoint_name(6)}.unreadable").read_bytes() == forged  # kept, never read
    with keyed(Sealing(KEY.encode())):
        assert_weights_equal(straight / "final.pth", run / "final.pth")
    assert (run / "log.csv").read_bytes() == (straight / "log.csv").read_bytes()


def test_inspect_says_which_seal_it_verified_and_refuses_a_keyed_file_without_the_key(tmp_path, monkeypatch):
    path = save_resume(tmp_path / "resume.pth", parts(), step=3, key=KEY)
    assert_one_line_error(call_cli("inspect", path), "sealed with a key, and no key is set")
    monkeypatch.setenv(KEY_VARIABLE, KEY)
    shown = call_cli("inspect", path)
    assert shown.returncode == 0
    assert "a keyed seal (HMAC-SHA-256) recorded in the file, bytes match it with the key set" in shown.stdout


def test_inspect_of_a_folder_tells_checkpoints_it_cannot_verify_from_damaged_ones(tmp_path, monkeypatch):
    with CheckpointStore(tmp_path, keep=None, key=KEY) as store:
        for step in (1, 2):
            store.save(step, parts())
    first = tmp_path / checkpoint_name(1)
    data = bytearray(first.read_bytes())
    data[100] ^= 1  # damaged: with a key, a seal that does not match reads as another key's would
    first.write_bytes(bytes(data))
    for key, said in [(None, "sealed with a key, none set"), (OTHER_KEY, "not verified by the key set")]:
        if key:
            monkeypatch.setenv(KEY_VARIABLE, key)
        listed = json.loads(call_cli("inspect", tmp_path, "--json").stdout)
        assert [c["status"] for c in listed["checkpoints"]] == ["not verified", "not verified"], listed
        assert f"2 checkpoints, 2 {said}; none verifies" in listed["description"]
        assert listed["checksum"] == "not verified"
    monkeypatch.setenv(KEY_VARIABLE, KEY)
    listed = json.loads(call_cli("inspect", tmp_path, "--json").stdout)
    assert [c["status"] for c in listed["checkpoints"]] == ["not verified", "verified"], listed
    assert "2 checkpoints, 1 not verified by the key set; a resume continues from step 2" in listed["description"]
    monkeypatch.delenv(KEY_VARIABLE)
    shown = call_cli("inspect", tmp_path).stdout  # without a key, the damaged one cannot be told from the other
    assert "2 checkpoints, 2 sealed with a key, none set" in shown and "damaged" not in shown


@pytest.mark.parametrize("sharded", [False, True], ids=["one file", "sharded"])
def test_inspect_of_an_object_store_prefix_tells_checkpoints_it_cannot_verify_as_a_folders_does(
    moto_s3, monkeypatch, sharded
):
    moto_s3.create_bucket(Bucket="keyed")
    with CheckpointStore("s3://keyed/run", keep=None, key=KEY, sharded=sharded) as store:
        store.save(1, parts())
    for key, status in [(None, "not verified"), (OTHER_KEY, "not verified"), (KEY, "verified")]:
        if key:
            monkeypatch.setenv(KEY_VARIABLE, key)
        listed = json.loads(call_cli("inspect", "s3://keyed/run", "--json").stdout)
        assert [c["status"] for c in listed["checkpoints"]] == [status], listed
        assert "damaged" not in listed["description"], listed


def test_a_state_kept_inside_a_frameworks_checkpoint_is_keyed_too():
    with keyed(Sealing(KEY.encode())):
        entry = sealed({"step": 3})
        assert "hmac_128" in entry and "xxh3_128" not in entry and opened(entry, "the .ckpt") == {"step": 3}
    with pytest.raises(CheckpointError, match="the .ckpt: sealed with a key, and no key is set"):
        opened(entry, "the .ckpt")
    with keyed(Sealing(OTHER_KEY.encode())), pytest.raises(CheckpointError, match="another key"):
        opened(entry, "the .ckpt")


def test_the_keyed_mac_is_the_same_however_its_bytes_arrive():
    data = bytes(range(256)) * (100_000)  # 25.6 MB: three whole pieces and a part
    sealing = Sealing(KEY.encode())
    for cuts in ([], [1], [8 << 20], [5, (8 << 20) + 3, 20_000_000], list(range(0, len(data), 3_000_001))):
        for kept in (False, True, "alternately"):  # update_kept: bytes that stay, hashed on the pool (a load)
            hasher = sealing.hasher()
            for number, (start, end) in enumerate(zip([0, *cuts], [*cuts, len(data)])):
                chunk = memoryview(data)[start:end]
                add = hasher.update_kept if kept is True or (kept and number % 2) else hasher.update
                add(chunk)
                twin = hasher.copy()  # a copy goes on alone (an upload seals a copy of what it has sent)
            assert twin.hexdigest() == hasher.hexdigest() == piece_mac(KEY, data), (cuts, kept)
    assert sealing.of(b"") == piece_mac(KEY, b"")


def test_a_keyed_checkpoint_damaged_before_its_read_back_is_removed(tmp_path, monkeypatch):
    """A keyed save's read-back holds the file to the bytes its MAC was computed over (at xxh3's speed)."""
    real_verify = disk.verify

    def verify_after_damage(path, *written):
        data = bytearray(path.read_bytes())
        data[len(data) // 3] ^= 1
        path.write_bytes(bytes(data))
        real_verify(path, *written)

    CheckpointStore(tmp_path, key=KEY).save(1, parts())
    monkeypatch.setattr(disk, "verify", verify_after_damage)
    with pytest.raises(StorageError, match="read back damaged"):
        CheckpointStore(tmp_path, key=KEY).save(2, parts())
    assert sorted(path.name for path in tmp_path.glob("step-*")) == [checkpoint_name(1)]


def test_a_keyed_store_never_prunes_or_saves_beside_checkpoints_it_cannot_verify(tmp_path):
    """Checkpoints of another sealing (here none) may be sound: a store that did not load them keeps them."""
    with CheckpointStore(tmp_path, keep=2) as store:
        for step in (1, 2, 3, 4):
            store.save(step, parts(step))
    theirs = {path.name: path.read_bytes() for path in tmp_path.glob("step-*")}  # steps 3 and 4
    with CheckpointStore(tmp_path, keep=2, key=KEY) as store:
        for step in (5, 6, 7):
            store.save(step, parts(step))
    assert {path.name: path.read_bytes() for path in tmp_path.glob("step-*") if path.name in theirs} == theirs
    assert sorted(path.name for path in tmp_path.glob("step-*")) == [checkpoint_name(n) for n in (3, 4, 6, 7)]
    with pytest.raises(CheckpointError, match=f"holds {checkpoint_name(3)}, which this store cannot verify"):
        CheckpointStore(tmp_path, key=OTHER_KEY).save(1, parts())


def test_the_reading_calls_take_a_key_and_an_empty_key_is_named_as_such(tmp_path, monkeypatch):
    path = save_resume(tmp_path / "resume.pth", parts(), step=3, key=KEY)
    assert read_resume(path, key=KEY)["checkpoint_step"] == 3
    assert open_resume(path, key=KEY).step == 3
    with pytest.raises(CheckpointError, match="sealed with a key, and no key is set"):
        open_resume(path)
    monkeypatch.setenv(KEY_VARIABLE, "")
    assert_one_line_error(call_cli("inspect", path), "EXACTRESUME_KEY is 0 bytes long: a key is at least 16")
