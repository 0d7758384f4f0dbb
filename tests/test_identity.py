"""A run's identity (`identity=`): kept with each checkpoint a store or `save_resume` writes, and a load
given one refuses another run's checkpoint in one line naming each field, loading nothing."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from exactresume.errors import CheckpointError, FieldError
from exactresume.store.access import load_resume, open_resume, save_resume
from exactresume.store.layout import checkpoint_name
from exactresume.store.numbered import CheckpointStore
from helpers import call_cli

SEED_0 = {"seed": 0, "steps": 120, "data": "kjv"}
SEED_1 = {"seed": 1, "steps": 200, "data": "kjv"}


def model(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in module.state_dict().items()}


def same_weights(module: torch.nn.Module, expected: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(tensor, expected[name]) for name, tensor in module.state_dict().items())


def fingerprints(folder: Path) -> dict[str, str]:
    """Every file under `folder` (the writer's lock aside) and the hash of its bytes."""
    files = [path for path in sorted(folder.rglob("*")) if path.is_file() and path.name != ".exactresume.lock"]
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest() for path in files}


def one_line(error: pytest.ExceptionInfo) -> str:
    line = str(error.value)
    assert "\n" not in line, line
    return line


STORES = {
    "folder": {},
    "background": {"background": True},
    "sharded": {"sharded": True},
}


@pytest.mark.parametrize("kind", STORES)
def test_a_store_refuses_another_runs_checkpoint_naming_each_field_and_loads_nothing(tmp_path, kind):
    options = STORES[kind]
    saved = model(0)
    with CheckpointStore(tmp_path / "run", keep=None, identity=SEED_0, **options) as store:
        store.save(10, {"model": saved})
    before = fingerprints(tmp_path / "run")
    other = model(1)
    untouched = weights(other)
    with CheckpointStore(tmp_path / "run", keep=None, identity=SEED_1, **options) as store:
        with pytest.raises(CheckpointError) as refused:
            store.load({"model": other})
        line = one_line(refused)
        for needle in ("seed: saved 0, given 1", "steps: saved 120, given 200", "nothing was loaded"):
            assert needle in line, line
        assert "data" not in line.split("another run:")[1] and "any_identity=True" in line, line
        assert same_weights(other, untouched)
        with pytest.raises(CheckpointError, match="not known to be this store's run"):
            store.save(0, {"model": other})  # a loop that starts over anyway writes nothing
        assert fingerprints(tmp_path / "run") == before
        # The way out the line names: the checkpoint loads, and the store's saves record its identity.
        assert store.load({"model": other}, any_identity=True) == 10
        assert same_weights(other, weights(saved))
        store.save(20, {"model": other})
    with CheckpointStore(tmp_path / "run", identity=SEED_1, **options) as store:
        assert store.load({"model": model(2)}) == 20


def test_a_store_refuses_another_runs_checkpoint_on_an_object_store(moto_s3):
    from exactresume.store.locations import S3Config

    moto_s3.create_bucket(Bucket="identity")
    folder, config = "s3://identity/run", S3Config()
    with CheckpointStore(folder, identity=SEED_0, config=config) as store:
        store.save(10, {"model": model(0)})
    other = model(1)
    untouched = weights(other)
    with CheckpointStore(folder, identity=SEED_1, config=config) as store, pytest.raises(CheckpointError) as refused:
        store.load({"model": other})
    assert "seed: saved 0, given 1" in one_line(refused) and same_weights(other, untouched)
    with CheckpointStore(folder, identity=dict(reversed(SEED_0.items())), config=config) as store:
        assert store.load({"model": other}) == 10  # the same identity, its keys in another order


def test_the_refused_checkpoint_is_not_passed_over_for_an_older_one_of_this_run(tmp_path):
    with CheckpointStore(tmp_path, keep=None, identity=SEED_0) as store:
        store.save(10, {"model": model(0)})
    with CheckpointStore(tmp_path, keep=None, identity=SEED_1) as store:
        store.load({"model": model(1)}, any_identity=True)
        store.save(20, {"model": model(1)})
    with CheckpointStore(tmp_path, identity=SEED_0) as store, pytest.raises(CheckpointError) as refused:
        store.load({"model": model(0)})
    assert checkpoint_name(20) in one_line(refused) and "seed: saved 1, given 0" in one_line(refused)


def test_a_field_on_one_side_only_is_named_and_a_checkpoint_without_identity_is_refused(tmp_path):
    with CheckpointStore(tmp_path / "a", identity={"seed": 0, "data": {"name": "kjv", "tokens": 10}}) as store:
        store.save(1, {"model": model()})
    given = {"seed": 0, "data": {"name": "kjv"}, "steps": 60}
    with CheckpointStore(tmp_path / "a", identity=given) as store, pytest.raises(CheckpointError) as refused:
        store.load({"model": model()})
    line = one_line(refused)
    assert "data.tokens: saved 10, given nothing" in line and "steps: saved nothing, given 60" in line, line
    assert "seed" not in line.split("another run:")[1]
    with CheckpointStore(tmp_path / "b") as store:
        store.save(1, {"model": model()})
    with CheckpointStore(tmp_path / "b", identity=SEED_0) as store, pytest.raises(CheckpointError) as refused:
        store.load({"model": model()})
    assert "records no run identity" in one_line(refused) and "any_identity=True" in one_line(refused)


def test_without_identity_a_load_is_as_before(tmp_path):
    saved = model(0)
    with CheckpointStore(tmp_path, identity=SEED_0) as store:
        store.save(10, {"model": saved})
    loaded = model(1)
    with CheckpointStore(tmp_path) as store:
        assert store.load({"model": loaded}) == 10
    assert same_weights(loaded, weights(saved))


def test_one_file_refuses_another_runs_state_and_identity_none_loads_it(tmp_path):
    saved = model(0)
    path = save_resume(tmp_path / "resume.pth", {"model": saved}, step=10, identity=SEED_0)
    other = model(1)
    untouched = weights(other)
    with pytest.raises(CheckpointError) as refused:
        load_resume(path, {"model": other}, identity=SEED_1)
    line = one_line(refused)
    assert "seed: saved 0, given 1" in line and "steps: saved 120, given 200" in line and "identity=None" in line
    assert same_weights(other, untouched)
    with pytest.raises(CheckpointError, match="seed: saved 0, given 1"):
        open_resume(path).restore({"model": other}, identity=SEED_1)
    assert same_weights(other, untouched)
    assert load_resume(path, {"model": other}, identity=SEED_0) == 10
    assert same_weights(other, weights(saved))
    assert load_resume(path, {"model": model(1)}) == 10  # identity=None: no check, as before


def test_a_sharded_folder_keeps_its_identity(tmp_path):
    folder = save_resume(tmp_path / "resume.dcp", {"model": model(0)}, step=3, sharded=True, identity=SEED_0)
    other = model(1)
    untouched = weights(other)
    with pytest.raises(CheckpointError, match="seed: saved 0, given 1"):
        open_resume(folder).restore({"model": other}, identity=SEED_1)
    assert same_weights(other, untouched)
    assert open_resume(folder).restore({"model": other}, identity=SEED_0) == 3


def test_a_plain_torch_load_reads_the_identity_and_a_file_saved_without_one_has_no_such_key(tmp_path):
    identity = {"seed": 0, "steps": 120, "lr": 3e-4, "data": {"name": "kjv", "files": ["a", "b"]}, "note": None}
    with CheckpointStore(tmp_path / "run", identity=identity) as store:
        store.save(10, {"model": model()})
    state = torch.load(tmp_path / "run" / checkpoint_name(10), weights_only=True)
    assert json.loads(state["identity"]) == identity
    plain = torch.load(save_resume(tmp_path / "plain.pth", {"model": model()}, step=1), weights_only=True)
    assert list(plain) == ["format", "version", "checkpoint_step", "model"]  # the lab's files keep their keys
    shown = call_cli("inspect", tmp_path / "run" / checkpoint_name(10))
    assert shown.returncode == 0 and "step 10" in shown.stdout, shown.stdout
    assert [line.split()[0] for line in shown.stdout.splitlines() if line.startswith("  model ")] == ["model"]
    assert not any(line.startswith("  identity ") for line in shown.stdout.splitlines())  # not taken for a part


@pytest.mark.parametrize(
    "identity, says",
    [
        ({"steps": (1, 2)}, "changes when written as JSON"),
        ({"lr": math.nan}, "changes when written as JSON"),
        ({"data": {1: "kjv"}}, "changes when written as JSON"),
        ({"model": torch.nn.Linear(1, 1)}, "JSON values only"),
        ({0: "seed"}, "a dict of str keys"),
        ("seed=0", "a dict of str keys"),
    ],
)
def test_an_identity_json_cannot_keep_is_refused_in_one_line_where_it_is_given(tmp_path, identity, says):
    calls = [
        lambda: CheckpointStore(tmp_path / "run", identity=identity),
        lambda: save_resume(tmp_path / "resume.pth", {"model": model()}, step=1, identity=identity),
        lambda: load_resume(tmp_path / "resume.pth", {"model": model()}, identity=identity),
    ]
    for call in calls:
        with pytest.raises(FieldError) as refused:
            call()
        assert says in one_line(refused) and refused.value.fields == ("identity",)
    assert list(tmp_path.iterdir()) == []
