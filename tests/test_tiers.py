"""Two tiers of checkpoints (store/tiers.py): every save to a local folder, every N-th step copied to the
durable one; a resume takes the newest checkpoint that verifies and is this run's across both, and falls
back to the durable tier when the local one is lost, damaged or another run's. The library in this
process; the trainer (`--local-checkpoints`, `--durable-every`) killed and resumed in new processes."""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from exactresume import CheckpointStore, StorageError, UserError
from exactresume.store.disk import DiskFolder, write_verified
from exactresume.store.identity import with_identity
from exactresume.store.layout import checkpoint_name
from helpers import assert_one_line_error, assert_weights_equal, run_cli, run_python, spawn_cli, train_cli

FLAGS = ["--steps", "12", "--batch", "4", "--seq-len", "16", "--preset", "tiny"]


def loop(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters())}


def step(parts: dict, number: int) -> None:
    torch.manual_seed(number)
    parts["optimizer"].zero_grad()
    parts["model"](torch.randn(3, 4)).sum().backward()
    parts["optimizer"].step()


def tiered(tmp_path: Path, **options) -> CheckpointStore:
    said = options.pop("said", [])
    options = {"keep": 2, "local": tmp_path / "local", "durable_every": 3, "notify": said.append} | options
    return CheckpointStore(tmp_path / "durable", **options)


def names(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.glob("step-*"))


def trained(tmp_path: Path, steps: int = 7, killed: bool = True, **options) -> dict:
    """`steps` saves; `killed`: the process then ends without `close` (as a kill ends it), so the durable
    tier holds the due steps alone."""
    parts = loop()
    store = tiered(tmp_path, **options)
    for number in range(1, steps + 1):
        step(parts, number)
        store.save(number, parts)
        store.wait()  # the copy in flight is in: no durable step is left to the local tier alone
    store.release() if killed else store.close()
    return parts


def test_every_save_lands_locally_and_every_nth_step_is_copied_durable_byte_for_byte(tmp_path):
    trained(tmp_path)
    assert names(tmp_path / "local") == [checkpoint_name(6), checkpoint_name(7)]
    assert names(tmp_path / "durable") == [checkpoint_name(3), checkpoint_name(6)]
    local, durable = (tmp_path / tier / checkpoint_name(6) for tier in ("local", "durable"))
    assert local.read_bytes() == durable.read_bytes()  # the local file's verified bytes, not a second torch.save
    assert torch.load(durable, weights_only=True)["checkpoint_step"] == 6  # a plain torch file


def test_one_checkpoint_of_every_stretch_of_n_steps_goes_durable_whichever_steps_are_saved(tmp_path):
    parts, store = loop(), tiered(tmp_path, keep=None, durable_every=5)
    for number in range(2, 17, 2):  # every second step, as --save-every 2 saves: no multiple of 5 but 10
        step(parts, number)
        store.save(number, parts)
        store.wait()
    store.release()
    assert names(tmp_path / "durable") == [checkpoint_name(n) for n in (6, 10, 16)]  # the first of 5-9, 10-14, 15-19


def test_a_step_due_while_a_copy_is_going_up_is_made_up_by_the_next_of_its_stretch(tmp_path):
    parts, store, uploading = loop(), tiered(tmp_path, keep=None, durable_every=5), threading.Event()
    write_copy = store.durable.durable.write_copy
    store.durable.durable.write_copy = lambda *args: (uploading.wait(10), write_copy(*args))  # a slow durable tier
    for number in range(5, 12):
        if number == 11:
            uploading.set()
            store.durable.wait()  # the copy of 5 is in
        step(parts, number)
        store.save(number, parts)
    store.durable.wait()
    store.release()  # killed here: no close copies the newest step
    assert store.durable.skipped == 1  # 10, while 5 was going up
    assert names(tmp_path / "durable") == [checkpoint_name(5), checkpoint_name(11)]


def test_close_copies_the_newest_local_step_durable_when_it_was_not_due(tmp_path):
    trained(tmp_path, killed=False)
    assert names(tmp_path / "durable") == [checkpoint_name(6), checkpoint_name(7)]  # keep=2 holds there too
    local, durable = (tmp_path / tier / checkpoint_name(7) for tier in ("local", "durable"))
    assert local.read_bytes() == durable.read_bytes()
    with tiered(tmp_path) as store:  # nothing newer locally: a close copies nothing again
        assert store.load(loop(1)) == 7
    assert durable.read_bytes() == local.read_bytes() and names(tmp_path / "durable")[-1] == checkpoint_name(7)


@pytest.mark.parametrize("loss", ["wiped", "damaged", "another run's"])
def test_a_resume_takes_the_newest_checkpoint_of_this_run_that_verifies_across_tiers(tmp_path, loss):
    identity = {"run": "a"}
    trained(tmp_path, identity=identity)
    local, expected = tmp_path / "local", {"wiped": 6, "damaged": 6, "another run's": 7}[loss]
    if loss == "wiped":
        shutil.rmtree(local)
    elif loss == "damaged":
        newest = local / checkpoint_name(7)
        data = bytearray(newest.read_bytes())
        data[len(data) // 2] ^= 1
        newest.write_bytes(bytes(data))
    else:  # a newer checkpoint another run left in the same local folder
        state = torch.load(local / checkpoint_name(7), weights_only=True) | {"checkpoint_step": 9}
        write_verified(local / checkpoint_name(9), with_identity(state, {"run": "b"}))
    resumed, said = loop(1), []
    with tiered(tmp_path, identity=identity, said=said) as store:
        assert store.load(resumed) == expected
    straight = loop()
    for number in range(1, expected + 1):
        step(straight, number)
    for name, tensor in straight["model"].state_dict().items():
        assert torch.equal(resumed["model"].state_dict()[name], tensor), name
    if loss == "wiped":
        assert said == [
            f"the local tier {local} holds no checkpoint (a new machine, or its folder wiped): "
            f"resuming from {tmp_path / 'durable' / checkpoint_name(6)}, the durable tier's newest"
        ]
    else:
        assert len(said) == 1 and ("damaged" if loss == "damaged" else "another run's, by its identity") in said[0]
    if loss == "another run's":  # never written over nor pruned: set aside when this run saves its step
        with tiered(tmp_path, identity=identity, said=said) as store:
            store.load(loop(1))
            for number in (8, 9, 10, 11):
                store.save(number, resumed)
        assert (local / (checkpoint_name(9) + ".unreadable")).is_file(), said
        assert any(line.startswith(f"set aside {local / checkpoint_name(9)}") for line in said), said


def test_a_local_tier_holding_only_another_runs_checkpoints_is_a_fresh_start(tmp_path):
    trained(tmp_path, identity={"run": "a"})
    shutil.rmtree(tmp_path / "durable")
    said = []
    with tiered(tmp_path, identity={"run": "b"}, said=said) as store:
        assert store.load(loop(1)) is None
    assert len(said) == 2 and all("another run's" in line for line in said), said


def test_a_checkpoint_ahead_is_named_in_the_tier_that_holds_it(tmp_path):
    trained(tmp_path)
    shutil.rmtree(tmp_path / "local")
    with pytest.raises(UserError, match=f"^{tmp_path / 'durable'} already holds step-00000006.pth, a checkpoint"):
        tiered(tmp_path).save(6, loop())


def test_a_copy_at_a_step_whose_damaged_checkpoint_was_set_aside_is_pruned_as_any(tmp_path):
    trained(tmp_path, steps=6)  # durable: 3, 6
    for tier in ("local", "durable"):
        damaged = tmp_path / tier / checkpoint_name(6)
        damaged.write_bytes(damaged.read_bytes()[:-100])
    parts = loop()
    with tiered(tmp_path) as store:
        assert store.load(parts) == 5
        for number in range(6, 13):
            store.save(number, parts)
            store.wait()
    aside = checkpoint_name(6) + ".unreadable"
    assert sorted(path.name for path in (tmp_path / "durable").iterdir()) == [aside, *map(checkpoint_name, (9, 12))]
    assert sorted(path.name for path in (tmp_path / "local").iterdir()) == [aside, *map(checkpoint_name, (11, 12))]


def test_what_the_tiers_cannot_do_is_one_line(tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "durable")
    for options, needle in (
        ({"durable_every": None}, "local= and durable_every= go together"),
        ({"local": None}, "durable_every= and local= go together"),
        ({"durable_every": 0}, "durable_every must be a whole number of steps of at least 1"),
        ({"sharded": True}, "a local tier holds one-file checkpoints"),
        ({"local": "s3://bucket/local"}, "local= is a folder on this machine's disk"),
        ({"local": 123}, "local= is a folder on this machine's disk, got 123"),
        ({"local": tmp_path / "durable" / "."}, "local= is the store's own folder"),
        ({"local": tmp_path / "link"}, "local= is the store's own folder"),  # through a link to it
    ):
        with pytest.raises(UserError, match=needle):
            tiered(tmp_path, **options)


def test_a_durable_tier_that_refuses_a_copy_is_one_line_and_the_local_tier_goes_on(tmp_path, monkeypatch):
    tried = []

    def refused(self, checkpoint, source):
        tried.append(checkpoint.step)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(DiskFolder, "write_copy", refused)
    parts, store = loop(), tiered(tmp_path)
    for number in (1, 2, 3):
        store.save(number, parts)
    with pytest.raises(StorageError) as told:
        store.wait()
    assert str(told.value).startswith(f"could not write the checkpoint at step 3 in {tmp_path / 'durable'}: ")
    assert "\n" not in str(told.value) and f"{tmp_path / 'local' / checkpoint_name(3)} is intact" in str(told.value)
    store.save(4, parts)  # the local tier goes on
    with pytest.raises(StorageError, match="at step 6 in"):  # the next due copy is tried again, and said
        store.save(6, parts)
        store.wait()
    with pytest.raises(StorageError, match="at step 6 in"):  # the close tries the newest once more, and says so
        store.close()
    assert tried == [3, 6, 6] and names(tmp_path / "local") == [checkpoint_name(4), checkpoint_name(6)]
    assert names(tmp_path / "durable") == []


def test_a_durable_tier_that_cannot_be_written_is_the_folder_the_line_names(tmp_path, small_disk):
    with CheckpointStore(small_disk / "durable") as store:
        store.save(1, loop())
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    try:
        store = CheckpointStore(small_disk / "durable", local=tmp_path / "local", durable_every=100)
        with pytest.raises(StorageError) as told:  # its first save locks both tiers, at a step not due durable
            store.save(2, loop())
        store.close()
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)
    durable = small_disk / "durable"
    assert str(told.value).startswith(f"could not write the checkpoint at step 2 in {durable}: Read-only file system")
    line = str(told.value)
    assert f"{durable / checkpoint_name(1)} is intact" in line and str(tmp_path / "local") not in line


def test_a_durable_tier_on_an_object_store(tmp_path, moto_s3):
    moto_s3.create_bucket(Bucket="tiers")
    prefix = "s3://tiers/run"
    parts = loop()
    with CheckpointStore(prefix, keep=2, local=tmp_path / "local", durable_every=2) as store:
        for number in range(1, 6):
            step(parts, number)
            store.save(number, parts)
            store.wait()
    keys = sorted(item["Key"] for item in moto_s3.list_objects_v2(Bucket="tiers")["Contents"])
    # steps 2 and 4 as they were due, then 5 by the close: the newest two kept
    assert keys == [f"run/{checkpoint_name(n)}{end}" for n in (4, 5) for end in ("", ".commit")]
    shutil.rmtree(tmp_path / "local")  # a node replaced: its local tier is gone
    with CheckpointStore(prefix, local=tmp_path / "local", durable_every=2) as store:
        assert store.load(loop(1)) == 5


# -- the trainer: --local-checkpoints DIR --durable-every N ------------------------------------------


@pytest.fixture(scope="module")
def straight(tmp_path_factory, kjv_folder) -> Path:
    out = tmp_path_factory.mktemp("straight")
    train_cli(out, "--data", kjv_folder, *FLAGS, check=True)
    return out


def tier_flags(out: Path) -> list[object]:
    return [*FLAGS, "--save-every", 1, "--local-checkpoints", out / "local", "--durable-every", 5]


def test_the_trainer_killed_at_a_random_moment_resumes_from_its_local_tier_bit_identical(
    straight, tmp_path, kjv_folder
):
    out, rng = tmp_path / "run", random.Random(11)
    run = spawn_cli("train", "--out", out, "--data", kjv_folder, *tier_flags(out))
    deadline, kill_after = time.monotonic() + 120, rng.randint(4, 9)
    while not (out / "log.csv").exists() or len((out / "log.csv").read_text().splitlines()) <= kill_after:
        assert run.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.01)
    time.sleep(rng.uniform(0, 0.1))
    run.send_signal(signal.SIGKILL)
    run.wait()
    finished = train_cli(out, "--data", kjv_folder, *tier_flags(out), "--resume", "auto", check=True)
    assert f"resumed from {out / 'local'}" in finished.stdout, finished.stdout
    assert_weights_equal(straight / "final.pth", out / "final.pth")
    assert (out / "log.csv").read_text() == (straight / "log.csv").read_text()


@pytest.mark.parametrize("loss", ["wiped", "damaged", "another run's"])
def test_the_trainer_resumes_from_the_right_tier_when_the_local_one_is_lost(straight, tmp_path, kjv_folder, loss):
    out = tmp_path / "run"
    stopped = train_cli(out, "--data", kjv_folder, *tier_flags(out), "--stop-at", 7, "--resume", "auto", check=True)
    local, durable = out / "local", out / "checkpoints"
    assert f"no checkpoint in {local} or {durable}; starting at step 0" in stopped.stdout  # both tiers looked in
    rows = [line.split(None, 2) for line in stopped.stdout.splitlines()]
    tiers = {words[0]: words[2] for words in rows if len(words) == 3 and words[1] == "checkpoint"}  # its summary
    assert tiers["local"].startswith(f"{local / checkpoint_name(7)}  (") and tiers["local"].endswith(", 3 kept)")
    assert tiers["durable"].startswith(f"{durable / checkpoint_name(7)}  (") and tiers["durable"].endswith(", 2 kept)")
    # the stop's close copied its last step durable: it outlives the node
    assert names(local) == [checkpoint_name(n) for n in (5, 6, 7)] and names(durable) == [
        checkpoint_name(5),
        checkpoint_name(7),
    ]
    if loss == "wiped":
        shutil.rmtree(local)
        expected = durable / checkpoint_name(7)
    elif loss == "damaged":
        newest = local / checkpoint_name(7)
        newest.write_bytes(newest.read_bytes()[:-100])
        expected = durable / checkpoint_name(7)
    else:
        state = torch.load(local / checkpoint_name(7), weights_only=True) | {"checkpoint_step": 9}
        write_verified(local / checkpoint_name(9), with_identity(state, {"out": str(tmp_path / "elsewhere")}))
        expected = local / checkpoint_name(7)
    if loss != "another run's":  # a listing cannot tell whose a checkpoint is; the run's resume does
        listed = run_cli("inspect", out / "checkpoints", "--local-checkpoints", local)
        assert listed.returncode == (1 if loss == "damaged" else 0), listed.stderr  # 1: a damaged one is listed
        step = expected.name[5:13].lstrip("0")
        assert f"two tiers; a resume continues from step {step} ({expected})" in listed.stdout, listed.stdout
    finished = train_cli(out, "--data", kjv_folder, *tier_flags(out), "--resume", "auto", check=True)
    assert f"resumed from {expected}" in finished.stdout, finished.stdout
    assert_weights_equal(straight / "final.pth", out / "final.pth")


def test_the_trainers_tier_flags_refuse_what_they_cannot_do(tmp_path, kjv_folder):
    for flags, needle in (
        (["--local-checkpoints", tmp_path / "local"], "--local-checkpoints and --durable-every N go together"),
        (["--durable-every", 2], "--local-checkpoints and --durable-every N go together"),
        (["--local-checkpoints", tmp_path / "l", "--durable-every", 2], "needs --save-every N"),
        (["--local-checkpoints", "s3://bucket/l"], "a local tier is a folder on this machine's disk, not an s3://"),
        (["--save-every", 1, "--durable-every", 2, "--local-checkpoints", tmp_path / "out"], "is OUT or --checkpoints"),
    ):
        finished = train_cli(tmp_path / "out", "--data", kjv_folder, *FLAGS, *flags)
        assert_one_line_error(finished, needle)
    unmakeable = ["--save-every", 1, "--durable-every", 2, "--local-checkpoints", "/proc/exactresume-local"]
    finished = train_cli(tmp_path / "run", "--data", kjv_folder, *FLAGS, *unmakeable)
    assert_one_line_error(finished, "cannot create --local-checkpoints folder /proc/exactresume-local")
    assert not (tmp_path / "run" / "log.csv").exists()  # said before a step was trained
    (tmp_path / "a-file").write_text("")
    finished = train_cli(tmp_path / "run", "--data", kjv_folder, *FLAGS, *unmakeable[:-1], tmp_path / "a-file")
    assert_one_line_error(finished, f"--local-checkpoints folder {tmp_path / 'a-file'} is a file, not a folder")


def test_two_runs_writing_one_durable_folder_outside_out_are_one_too_many(tmp_path, kjv_folder):
    """--checkpoints outside OUT is locked by the run writing it, as OUT is: a second run is refused."""
    shared = tmp_path / "shared"
    tiers = ["--save-every", 1, "--local-checkpoints", tmp_path / "a-local", "--durable-every", 1]
    long_run = ["--steps", 400, "--batch", 4, "--seq-len", 16, "--preset", "tiny", *tiers, "--checkpoints", shared]
    first = spawn_cli("train", "--out", tmp_path / "a", "--data", kjv_folder, *long_run)
    deadline = time.monotonic() + 120
    while not list(shared.glob("step-*.pth")):
        assert first.poll() is None and time.monotonic() < deadline, first.output()
        time.sleep(0.02)
    second = train_cli(tmp_path / "b", "--data", kjv_folder, *FLAGS, "--save-every", 1, "--checkpoints", shared)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert_one_line_error(second, f"{shared} is being written by pid {first.pid}")


LEAVES_ITS_STORE_OPEN = """
import sys
import torch
from exactresume import CheckpointStore

model = torch.nn.Linear(4, 2)
store = CheckpointStore(sys.argv[1], local=sys.argv[2], durable_every=4, background=True)
for step in range(1, 7):
    store.save(step, {"model": model})
"""


def test_a_script_that_leaves_its_tiered_store_open_has_its_last_step_copied_durable_at_exit(tmp_path):
    """As `close` would: the interpreter's exit copies the newest local step the durable tier lacks."""
    script = tmp_path / "open.py"
    script.write_text(LEAVES_ITS_STORE_OPEN)
    finished = run_python(script, tmp_path / "durable", tmp_path / "local")
    assert finished.returncode == 0 and finished.stdout == "", finished.stdout
    assert names(tmp_path / "durable") == [checkpoint_name(4), checkpoint_name(6)]
    assert (tmp_path / "durable" / checkpoint_name(6)).read_bytes() == (
        tmp_path / "local" / checkpoint_name(6)
    ).read_bytes()
