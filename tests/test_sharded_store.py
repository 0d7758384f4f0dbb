"""A store of sharded checkpoints (`CheckpointStore(folder, sharded=True)`) in one process: the rules of
a CheckpointStore hold for its folders: keep the newest `keep`, clear a killed save's NAME.tmp/, skip a
checkpoint whose files do not verify (naming it), never save over one it has not loaded, and refuse
what it cannot do in one line. Many processes and FSDP2: tests/users/test_store_ranks.py and
test_fsdp_user.py."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch

from exactresume import CheckpointStore, UserError, load_resume, save_resume
from exactresume.errors import CheckpointError
from exactresume.store import sharded
from exactresume.store.access import open_resume
from exactresume.store.collector import older_objects_frozen
from exactresume.store.dcp_writer import HashingWriter
from exactresume.store.seal_hash import UNKEYED, Sealing, keyed
from exactresume.store.sealed import file_digest
from exactresume.world import World

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process, as meant


def loop(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters())}


def train(parts: dict, step: int) -> None:
    torch.manual_seed(step)
    parts["optimizer"].zero_grad()
    parts["model"](torch.randn(3, 4)).sum().backward()
    parts["optimizer"].step()


def test_keep_leftovers_damage_and_fallback(tmp_path):
    parts, said = loop(0), []
    with CheckpointStore(tmp_path, keep=2, sharded=True) as store:
        for step in range(1, 4):
            train(parts, step)
            assert store.save(step, parts) == tmp_path / f"step-{step:08d}.dcp"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-00000002.dcp", "step-00000003.dcp"]
    (tmp_path / "step-00000004.dcp.tmp").mkdir()  # a save killed before its commit
    shard = next((tmp_path / "step-00000003.dcp").glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # the newest one damaged
    resumed = loop(1)
    with CheckpointStore(tmp_path, keep=2, sharded=True, notify=said.append) as store:
        assert store.load(resumed) == 2
        assert not (tmp_path / "step-00000004.dcp.tmp").exists()
        assert len(said) == 1 and "step-00000003.dcp" in said[0] and "damaged" in said[0], said
        for step in (3, 4):  # the damaged one is set aside, not replaced, and keep counts the new ones
            store.save(step, loop(step))
    assert "set aside" in said[-1] and "step-00000003.dcp.unreadable" in said[-1], said
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "step-00000003.dcp",
        "step-00000003.dcp.unreadable",
        "step-00000004.dcp",
    ]
    assert open_resume(tmp_path, notify=said.append).kind == "sharded"  # the same folder, read by open_resume
    straight = loop(0)
    train(straight, 1), train(straight, 2)  # what was loaded at step 2
    for name, tensor in straight["model"].state_dict().items():
        assert torch.equal(resumed["model"].state_dict()[name], tensor), name


def test_a_shard_that_reads_back_damaged_is_never_committed(tmp_path, monkeypatch):
    parts = loop(0)
    with CheckpointStore(tmp_path, sharded=True) as store:
        store.save(1, parts)
        write = sharded.dcp.save

        def damaging(state, storage_writer, **kwargs):
            write(state, storage_writer=storage_writer, **kwargs)
            shard = tmp_path / "step-00000002.dcp.tmp" / "__0_0.distcp"
            shard.write_bytes(shard.read_bytes()[:-1] + b"!")  # changed after it was written and hashed

        monkeypatch.setattr(sharded.dcp, "save", damaging)
        with pytest.raises(CheckpointError, match=r"step-00000002.dcp: __0_0.distcp read back damaged .*not committed"):
            store.save(2, parts)
    assert not (tmp_path / "step-00000002.dcp").exists()
    monkeypatch.undo()
    assert CheckpointStore(tmp_path, sharded=True).load(loop(1)) == 1


def test_a_folder_it_has_not_loaded_is_not_written_over(tmp_path):
    CheckpointStore(tmp_path, sharded=True).save(5, loop(0))
    with pytest.raises(
        CheckpointError, match="already holds step-00000005.dcp, a checkpoint this store has not loaded"
    ):
        CheckpointStore(tmp_path, sharded=True).save(5, loop(1))


def test_what_a_sharded_store_cannot_do_is_one_line(tmp_path):
    with pytest.raises(UserError, match="a sharded store saves in the foreground"):
        CheckpointStore(tmp_path, sharded=True, background=True)


def test_an_object_store_without_boto3_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "botocore", None)
    monkeypatch.setitem(sys.modules, "botocore.exceptions", None)
    for call in (lambda: CheckpointStore("s3://bucket/run").load(loop(0)), lambda: open_resume("s3://bucket/r.pth")):
        with pytest.raises(UserError, match=r"s3:// locations need boto3: pip install 'exactresume\[s3\]'"):
            call()


@pytest.mark.parametrize("seals", [UNKEYED, Sealing(b"a key of 32 bytes, for the test.")], ids=["xxh3", "keyed"])
def test_each_file_dcp_writes_is_hashed_as_it_is_written(tmp_path, seals):
    """The checksums a sharded save commits come from the bytes DCP wrote, not from reading its files again:
    they must be the files' own, index (written under another name, then renamed) included."""
    import torch.distributed.checkpoint as dcp

    state = {"weights": torch.randn(300, 70), "moments": {"step": torch.tensor(3.0), "note": "a string", "n": 7}}
    writer = HashingWriter(tmp_path, seals)
    dcp.save(state, storage_writer=writer, no_dist=True)
    with keyed(seals):
        on_disk = {path.name: file_digest(path) for path in tmp_path.iterdir()}
    assert set(on_disk) == {".metadata", "__0_0.distcp"} and writer.digests == on_disk


@pytest.mark.parametrize("saved_sharded", [True, False], ids=["sharded saved, one-file opened", "the reverse"])
def test_a_store_of_the_other_kind_refuses_the_folder_rather_than_start_fresh_beside_it(tmp_path, saved_sharded):
    """A loop that forgot `sharded=True` on its resume (or gave it to one-file checkpoints) found nothing of its
    own kind: its load returned None and its saves went on from step 1 beside the run's, a silent restart."""
    parts = loop(0)
    with CheckpointStore(tmp_path, sharded=saved_sharded) as store:
        for step in (1, 2, 3):
            train(parts, step)
            store.save(step, parts)
    saved = sorted(path.name for path in tmp_path.iterdir())
    later = "step-00000003.dcp" if saved_sharded else "step-00000003.pth"
    for attempt in (lambda store: store.load(loop(1)), lambda store: store.save(1, loop(1))):
        with CheckpointStore(tmp_path, sharded=not saved_sharded) as store:
            with pytest.raises(CheckpointError, match=f"holds {later}, a .* checkpoint later than any") as refused:
                attempt(store)
        assert ("sharded=True" in str(refused.value)) == saved_sharded
        assert sorted(path.name for path in tmp_path.iterdir()) == saved  # nothing written, nothing removed
    with CheckpointStore(tmp_path, sharded=not saved_sharded) as store:  # a save past that run's goes on
        store.save(4, loop(4))
    with CheckpointStore(tmp_path, sharded=not saved_sharded) as store:
        assert store.load(loop(1)) == 4


def test_a_checkpoint_passed_over_is_said_once_by_rank_0_not_by_every_rank(tmp_path):
    """Every rank reads the one folder alike: each saying it printed the line once per process."""
    parts = loop(0)
    with CheckpointStore(tmp_path, sharded=True) as store:
        for step in (1, 2):
            store.save(step, parts)
    shard = next((tmp_path / "step-00000002.dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1])
    for rank, lines in ((0, 1), (1, 0)):
        said: list[str] = []
        with CheckpointStore(tmp_path, sharded=True, notify=said.append, world=World(rank, 2)) as store:
            assert store.load(loop(1), clean=False) == 1
        assert len(said) == lines and all("skipping damaged checkpoint" in line for line in said), said


@pytest.mark.parametrize("cut", [1, -1], ids=["truncated", "appended_to"])
def test_a_shard_cut_short_or_grown_is_named_with_its_size_and_the_commits(tmp_path, cut):
    with CheckpointStore(tmp_path, sharded=True) as store:
        store.save(1, loop(0))
    folder = tmp_path / "step-00000001.dcp"
    for name in (next(folder.glob("*.distcp")).name, ".metadata"):
        path = folder / name
        good = path.read_bytes()
        path.write_bytes(good[:-cut] if cut > 0 else good + b"\0")
        with pytest.raises(CheckpointError) as refused:
            open_resume(folder)
        how = "truncated" if cut > 0 else "appended to"
        sizes = f"it holds {len(good) - cut:,} bytes, its commit marker says {len(good):,}"
        assert str(refused.value) == f"{folder}: {name} is damaged, {how}: {sizes}"
        path.write_bytes(good)


def test_a_sharded_save_leaves_the_objects_it_found_out_of_its_collections(tmp_path):
    """older_objects_frozen: what the process held before is set aside (a collection walks only what the save
    makes, and collects that), then put back; a process that froze objects itself keeps its freeze."""

    class Cycle:
        pass

    before = len(gc.get_objects())
    with older_objects_frozen():
        assert gc.get_freeze_count() >= before
        made = Cycle()
        made.me = made
        found = weakref.ref(made)
        del made
        gc.collect()
        assert found() is None  # made in the save and left over: collected as usual
    assert gc.get_freeze_count() == 0
    seen = []

    class Watched(torch.nn.Linear):
        def state_dict(self, *args, **kwargs):
            seen.append(gc.get_freeze_count())
            return super().state_dict(*args, **kwargs)

    with CheckpointStore(tmp_path, sharded=True) as store:
        store.save(1, {"model": Watched(4, 2)})
    assert seen and all(count > 0 for count in seen) and gc.get_freeze_count() == 0  # the save ran frozen
    gc.freeze()
    try:
        with older_objects_frozen():
            pass
        assert gc.get_freeze_count() > 0  # not unfrozen (its count moves as frozen objects die)
    finally:
        gc.unfreeze()


def two_modules(seed: int) -> dict:
    """A loop whose optimizer steps two module parts: no one part holds its parameters, so its state is
    torch's own, keyed by parameter index."""
    torch.manual_seed(seed)
    body, head = torch.nn.Linear(4, 2), torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW([{"params": body.parameters()}, {"params": head.parameters(), "lr": 0.1}])
    return {"body": body, "head": head, "optimizer": optimizer}


def step_two_modules(parts: dict, step: int) -> None:
    torch.manual_seed(step)
    parts["optimizer"].zero_grad()
    parts["head"](parts["body"](torch.randn(3, 4))).sum().backward()
    parts["optimizer"].step()


def test_an_optimizer_keyed_by_index_resumes_with_every_moment(tmp_path):
    """DCP names the key 0 of torch's optimizer state "0": read back as such, no parameter had its moments
    (load_state_dict matched none, silently) and the next save failed on the two keys "0" and 0."""
    straight, saved = two_modules(0), two_modules(0)
    for step in (1, 2):
        step_two_modules(saved, step)
    with CheckpointStore(tmp_path, sharded=True) as store:
        store.save(2, saved)
    resumed = two_modules(1)
    with CheckpointStore(tmp_path, sharded=True) as store:
        assert store.load(resumed) == 2
        state = resumed["optimizer"].state_dict()
        assert sorted(state["state"]) == [0, 1, 2, 3] and state["param_groups"][0]["betas"] == (0.9, 0.999)
        for step in (3, 4):
            step_two_modules(resumed, step)
            store.save(step, resumed)
    for step in (1, 2, 3, 4):
        step_two_modules(straight, step)
    for name in ("body", "head"):
        for key, tensor in straight[name].state_dict().items():
            assert torch.equal(resumed[name].state_dict()[key], tensor), (name, key)
    expected = straight["optimizer"].state_dict()["state"]
    for index, moments in resumed["optimizer"].state_dict()["state"].items():
        for key, tensor in moments.items():
            assert torch.equal(tensor, expected[index][key]), (index, key)


def test_a_sharded_folder_given_to_the_one_file_reader_names_the_reader_to_use(tmp_path):
    save_resume(tmp_path / "resume", loop(0), step=1, sharded=True)
    with pytest.raises(
        CheckpointError, match=r"is a folder, not a checkpoint file: a sharded checkpoint, read by open_resume"
    ):
        load_resume(tmp_path / "resume", loop(1))
    with pytest.raises(CheckpointError, match=r"is a folder, not a checkpoint file$"):
        load_resume(tmp_path, loop(1))  # a folder of no checkpoint: nothing more to say
