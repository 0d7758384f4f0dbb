"""store/containers.py: a sharded checkpoint gives back its parts' containers as they were saved, which
DCP's names alone do not: keys that are not strings, tuples, empty containers. Established by hand
first: DCP names every dict key as text, and an empty dict leaves no name (the first test reads DCP's own
index); what it pickles whole (a tuple, a list of plain values) comes back as it was."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from exactresume import UserError, open_resume, save_resume

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process, as meant


class Held:
    """A part whose state is whatever it was given."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


STATE = {
    "by_index": {0: torch.ones(2), 7: {"step": 3}},
    "odd_keys": {1.5: "x", None: 1, True: torch.zeros(1), "text": 2},
    "betas": (0.9, 0.999),
    "nested": ((1, 2), [3, (4,)]),
    "empty": {"dict": {}, "list": [], "tuple": (), "deep": {"a": {"b": {}}}},
    "list_of_empties": [{}, []],
}


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(map(same, a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_dcp_names_keys_as_text_walks_tuples_as_lists_and_leaves_empties_unnamed(tmp_path):
    dcp.save({"part": STATE}, checkpoint_id=tmp_path, no_dist=True)
    named = FileSystemReader(tmp_path).read_metadata().state_dict_metadata
    assert "part.by_index.0" in named and "part.odd_keys.None" in named  # 0 and None written as text
    assert not [name for name in named if name.startswith("part.empty.dict")]  # an empty dict has no name


def test_a_sharded_checkpoint_gives_back_the_containers_it_saved(tmp_path):
    save_resume(tmp_path / "resume", {"part": Held(STATE)}, step=1, sharded=True)
    loaded = Held({})
    open_resume(tmp_path / "resume").restore({"part": loaded})
    assert same(loaded.state, STATE), loaded.state


@pytest.mark.parametrize(
    "state, needle",
    [
        ({"both": {0: 1, "0": 2}}, "part.both has two keys written '0' \\(0 and '0'\\)"),
        ({"a": {(1, 2): 1}}, "keys its dicts by strings, numbers, booleans or None; part.a has a key of type tuple"),
    ],
)
def test_keys_a_sharded_checkpoint_cannot_name_apart_are_refused_before_a_byte_is_written(tmp_path, state, needle):
    with pytest.raises(UserError, match=needle):
        save_resume(tmp_path / "resume", {"part": Held(state)}, step=1, sharded=True)
    assert not (tmp_path / "resume").exists()
