"""store/save_plans.py: a sharded save reuses DCP's save plans of the save before while the state's
layout is the same, and plans afresh when any of it changed. Established by hand first, and kept as
the first test: DCP's own plan keeping judges a plan unchanged by its items' names, shapes and offsets,
so a state cast to bf16 between two saves is indexed as fp32. The ranks' agreement on the layout runs
on two processes in tests/test_fsdp.py and tests/users/test_store_ranks.py (saves of one layout,
resumed bit for bit)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader

from exactresume import CheckpointStore
from exactresume.store.save_plans import _forget_layouts_but, layout_digest
from exactresume.world import World

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process, as meant


def saved_dtype(folder, name: str) -> torch.dtype:
    """The dtype DCP's index (.metadata) gives the item `name`, read with DCP's own reader."""
    return FileSystemReader(folder).read_metadata().state_dict_metadata[name].properties.dtype


def test_dcp_keeping_its_own_plans_indexes_a_state_cast_between_saves_as_it_was(tmp_path):
    def keeping() -> DefaultSavePlanner:
        planner = DefaultSavePlanner(enable_plan_caching=True)
        planner._cached_plans_key = "exactresume.layout.test-dcp-own"
        return planner

    try:
        for dtype in (torch.float32, torch.bfloat16):
            state = {"w": torch.ones(3, dtype=dtype)}
            dcp.save(state, checkpoint_id=tmp_path / str(dtype), planner=keeping(), no_dist=True)
    finally:
        _forget_layouts_but("")
    assert saved_dtype(tmp_path / str(torch.bfloat16), "w") == torch.float32  # the bf16 tensor indexed as fp32


def test_a_store_reuses_the_plans_while_the_layout_holds_and_plans_afresh_when_it_changes(tmp_path, monkeypatch):
    planned, plan = [], DefaultSavePlanner._create_global_plan
    monkeypatch.setattr(DefaultSavePlanner, "_create_global_plan", lambda *args: planned.append(1) or plan(*args))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    with CheckpointStore(tmp_path, keep=3, sharded=True) as store:
        store.save(1, {"model": model})
        store.save(2, {"model": model})
        assert len(planned) == 1  # the second save planned nothing
        model.to(torch.bfloat16)
        store.save(3, {"model": model})
        assert len(planned) == 2
    assert saved_dtype(tmp_path / "step-00000002.dcp", "model.weight") == torch.float32
    assert saved_dtype(tmp_path / "step-00000003.dcp", "model.weight") == torch.bfloat16
    loaded = torch.nn.Linear(4, 2).to(torch.bfloat16)
    assert CheckpointStore(tmp_path, sharded=True).load({"model": loaded}) == 3
    for name, tensor in model.state_dict().items():
        assert loaded.state_dict()[name].dtype == torch.bfloat16 and torch.equal(loaded.state_dict()[name], tensor)


def test_the_layout_digest_holds_dtypes_shapes_and_nesting_not_values():
    weights = torch.zeros(2, 3)
    digest = layout_digest({"a": [weights], "step": 1})
    assert layout_digest({"a": [torch.ones(2, 3)], "step": 9}) == digest  # values: a plan does not hold them
    for changed in (
        {"a": [weights.to(torch.bfloat16)], "step": 1},
        {"a": [torch.zeros(3, 2)], "step": 1},
        {"a": {0: weights}, "step": 1},  # DCP flattens both to "a.0"
        {"a": {"0": weights}, "step": 1},
        {"a": (weights,), "step": 1},
        {"a": [weights, weights], "step": 1},
        {"a": [weights], "step": 1.0},
        {"a": [weights]},
    ):
        assert layout_digest(changed) != digest, changed
    assert 0 <= digest < 2**62


class TwoRanks:
    """torch.distributed for World.agree as two ranks see it: all_reduce(MAX) with the other rank's tensor."""

    class ReduceOp:
        MAX = "max"

    def __init__(self, other: int):
        self.other = other

    def all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        assert op == "max"
        tensor.copy_(torch.maximum(tensor, torch.tensor([self.other, -self.other])))


def test_the_ranks_agree_only_on_one_value(monkeypatch):
    world = World(rank=0, size=2)
    for mine, theirs, agreed in ((5, 5, True), (5, 6, False), (6, 5, False), (0, 2**62 - 1, False), (-3, -3, True)):
        monkeypatch.setattr(World, "_group", lambda self, theirs=theirs: TwoRanks(theirs))
        assert world.agree(mine) is agreed, (mine, theirs)
    assert World().agree(7)  # one process agrees with itself
