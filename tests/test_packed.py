"""The packed layout (resume files of version 2): the exact state back, bit for bit, by every reader."""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch

from conftest import one_torch_thread
from exactresume.config import TrainConfig
from exactresume.core.data import load_tokens
from exactresume.errors import CheckpointError
from exactresume.store import sealed
from exactresume.store.folder import CheckpointStore, snapshot
from exactresume.store.inspect import inspect_checkpoint
from exactresume.store.packed import is_packed, pack, packing, unpack
from exactresume.store.resume import capture, load_resume, restore, save_resume
from exactresume.store.sealed import load_sealed, save_sealed
from exactresume.training.loop import build_run, train


def assert_identical(saved, loaded, where="state") -> None:
    """Same types all the way down; tensors of the same dtype, shape, strides and bytes."""
    assert type(loaded) is type(saved), where
    if isinstance(saved, torch.Tensor):
        assert (loaded.dtype, loaded.shape, loaded.stride()) == (saved.dtype, saved.shape, saved.stride()), where
        assert loaded.requires_grad == saved.requires_grad, where
        # bytes, not values: a NaN's payload and -0.0 count too
        assert torch.equal(as_bytes(loaded), as_bytes(saved.detach().cpu())), where
    elif isinstance(saved, dict):
        assert list(loaded) == list(saved), where
        assert vars(loaded) == vars(saved) if isinstance(saved, OrderedDict) else True, where
        for key in saved:
            assert_identical(saved[key], loaded[key], f"{where}[{key!r}]")
    elif isinstance(saved, (list, tuple)):
        assert len(loaded) == len(saved), where
        for index, (a, b) in enumerate(zip(saved, loaded)):
            assert_identical(a, b, f"{where}[{index}]")
    elif isinstance(saved, float) and math.isnan(saved):
        assert math.isnan(loaded), where
    else:
        assert loaded == saved and repr(loaded) == repr(saved), where


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


@pytest.fixture(scope="module")
def fp16_run(kjv_folder):
    """A run with every kind of part: tied weights, AdamW state (int keys), a loss scaler, generator and RNGs."""
    with one_torch_thread():
        run = build_run(TrainConfig(steps=8, batch=2, seq_len=16, dtype="fp16", dropout=0.1), load_tokens(kjv_folder))
        train(run, until=2)
        yield run


def odd_state() -> dict:
    """What the JSON structure must keep apart: int and str keys, tuples and lists, -0.0, NaN, huge ints,
    every dtype, empty and 0-dim tensors, views into one storage, non-contiguous and tied tensors."""
    base = torch.arange(24, dtype=torch.float32)
    ordered = OrderedDict(a=torch.ones(2))
    ordered._metadata = OrderedDict({"": {"version": 1}})
    return {
        "format": "test",
        "keys": {0: "int", "0": "str", (1, 2): "tuple", None: "none", True: "bool", 1.5: "float"},
        "numbers": [0, -1, 2**80, -0.0, math.inf, -math.inf, math.nan, 1e-310, True, None],
        "nested": ([1, (2, [3])], (), [], {}, torch.Size([2, 3])),
        "text": ["", 'ü ∑ \x00 "quoted"', b"\x00\xffbytes"],
        "dtypes": [torch.float16, torch.bfloat16, torch.int64, torch.bool],
        "ordered": ordered,
        "tensors": {
            **{str(d): torch.arange(6).to(d) for d in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32)},
            **{
                str(d): torch.randn(3, 2).to(d) for d in (torch.float16, torch.bfloat16, torch.float64, torch.complex64)
            },
            "nan_payload": torch.tensor([0x7FC00001, -2147483648], dtype=torch.int32).view(torch.float32),
            "empty": torch.empty(0, 5),
            "scalar": torch.tensor(3.25),
            "strided": torch.arange(20.0).reshape(4, 5).t(),
            "view_a": base[2:10].view(2, 4),
            "view_b": base[5:],  # overlaps view_a: one storage, as saved
            "expanded": torch.ones(1, 3).expand(4, 3),
            "needs_grad": torch.ones(2, requires_grad=True),
        },
    }


def test_every_kind_of_value_comes_back_identical_by_both_readers(tmp_path):
    state = odd_state()
    save_sealed(tmp_path / "odd.pth", pack(state))
    assert_identical(state, load_sealed(tmp_path / "odd.pth"))
    loaded = torch.load(tmp_path / "odd.pth", weights_only=True)  # a plain torch file, no custom globals
    assert is_packed(loaded) and loaded["format"] == "test"
    assert_identical(state, unpack(loaded))


def test_storages_are_shared_exactly_as_saved(tmp_path):
    state = odd_state()
    save_sealed(tmp_path / "odd.pth", pack(state))
    tensors = load_sealed(tmp_path / "odd.pth")["tensors"]
    a, b = tensors["view_a"], tensors["view_b"]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    a[0, 3] = -7.0  # element 5 of the saved storage, which view_b starts at
    assert b[0] == -7.0
    others = [t for name, t in tensors.items() if name not in ("view_a", "view_b") and t.numel()]
    assert len({t.untyped_storage().data_ptr() for t in others}) == len(others)


def test_a_real_state_round_trips_with_int_keys_scaler_rng_and_ties(tmp_path, fp16_run):
    state = capture(fp16_run.parts())
    assert "scaler" in state and isinstance(next(iter(state["optimizer"]["state"])), int)
    save_resume(tmp_path / "resume.pth", fp16_run.parts())
    loaded = load_resume(tmp_path / "resume.pth")
    assert_identical(state, loaded)
    model = loaded["model"]
    assert model["lm_head.weight"].data_ptr() == model["model.embed_tokens.weight"].data_ptr()
    assert loaded["rng"]["torch"].dtype == torch.uint8 and loaded["version"] == 2


def test_loaded_optimizer_state_is_private_to_each_tensor(tmp_path, fp16_run):
    """The optimizer writes its loaded state in place: no tensor may reach another's bytes."""
    save_resume(tmp_path / "resume.pth", fp16_run.parts())
    loaded = load_resume(tmp_path / "resume.pth")
    moments = [t for entry in loaded["optimizer"]["state"].values() for t in entry.values()]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in moments)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in moments)
    before = [t.clone() for t in moments]
    moments[0].add_(1.0)
    assert all(torch.equal(t, b) for t, b in zip(moments[1:], before[1:]))


def test_resuming_from_a_packed_file_matches_the_straight_run(tmp_path, kjv_folder):
    with one_torch_thread():
        config, data = TrainConfig(steps=6, batch=2, seq_len=16, dropout=0.1), load_tokens(kjv_folder)
        straight = build_run(config, data)
        train(straight, until=4)
        stopped = build_run(config, data)
        train(stopped, until=2)
        save_resume(tmp_path / "resume.pth", stopped.parts())
        resumed = build_run(config, data)
        restore(load_resume(tmp_path / "resume.pth"), resumed.parts())
        train(resumed, until=4)
    for name, value in straight.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name


def test_a_version_1_file_still_loads_and_resumes_bit_exactly(tmp_path, kjv_folder):
    """Version 1, written the old way: the state itself, one pickle record per tensor."""
    with one_torch_thread():
        config, data = TrainConfig(steps=6, batch=2, seq_len=16, dropout=0.1), load_tokens(kjv_folder)
        straight = build_run(config, data)
        train(straight, until=4)
        stopped = build_run(config, data)
        train(stopped, until=2)
        save_sealed(tmp_path / "v1.pth", capture(stopped.parts()) | {"version": 1})
        store = CheckpointStore(tmp_path / "store")
        store._ensure_folder()
        save_sealed(store.path_for(2), snapshot(2, stopped.parts()) | {"version": 1})
        assert not is_packed(torch.load(tmp_path / "v1.pth", weights_only=True))
        for source in ("file", "store"):
            resumed = build_run(config, data)
            if source == "file":
                restore(load_resume(tmp_path / "v1.pth"), resumed.parts())
            else:
                assert store.restore(resumed.parts()) == 2
            train(resumed, until=4)
            for name, value in straight.model.state_dict().items():
                assert torch.equal(value, resumed.model.state_dict()[name]), (source, name)
    assert "one record per tensor" in inspect_checkpoint(tmp_path / "v1.pth")["description"]


def test_the_same_state_packs_to_the_same_bytes(tmp_path, fp16_run):
    save_resume(tmp_path / "a.pth", fp16_run.parts())
    save_resume(tmp_path / "b.pth", fp16_run.parts())
    assert (tmp_path / "a.pth").read_bytes() == (tmp_path / "b.pth").read_bytes()


@pytest.mark.parametrize("where", ["pickle", "storage", "last byte before the seal"])
def test_a_flipped_byte_anywhere_is_refused_in_one_line(tmp_path, fp16_run, where):
    path = tmp_path / "resume.pth"
    save_resume(path, fp16_run.parts())
    data = bytearray(path.read_bytes())
    offset = {"pickle": 200, "storage": len(data) // 2, "last byte before the seal": len(data) - 80}[where]
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch") as refused:
        load_resume(path)
    assert len(str(refused.value).splitlines()) == 1


def test_a_truncated_file_is_refused(tmp_path, fp16_run):
    path = tmp_path / "resume.pth"
    save_resume(path, fp16_run.parts())
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="no exactresume checksum"):
        load_resume(path)


def test_an_unsealed_packed_file_loads_without_the_seal_check(tmp_path):
    state = odd_state()
    torch.save(pack(state), tmp_path / "plain.pth")
    assert_identical(state, load_sealed(tmp_path / "plain.pth", require_seal=False))


def test_values_json_cannot_hold_are_refused_at_save():
    with pytest.raises(TypeError, match="cannot pack a builtins.set"):
        pack({"format": "test", "part": {1, 2}})
    with pytest.raises(TypeError, match="layout"):
        pack({"part": torch.eye(3).to_sparse()})


def test_objects_not_packed_pass_through_unpack():
    plain = {"weight": torch.ones(2)}
    assert unpack(plain) is plain


def test_a_damaged_structure_is_one_checkpoint_error():
    packed = pack({"format": "test", "part": torch.ones(4)})
    packed["structure"] = packed["structure"].replace('"tensor",0', '"tensor",9')
    with pytest.raises(CheckpointError, match="damaged packed structure|outside"):
        unpack(packed)
    packed["structure"] = '{"regions":[0,0,16],"state":["exec","x"]}'
    with pytest.raises(CheckpointError, match="unknown node"):
        unpack(packed)
    for reach in ('[0,0,16],"state":["tensor",0,"float32",0,[5]]', '[0,16,0],"state":["tensor",0,"uint8",0,[9]]'):
        packed["structure"] = '{"regions":' + reach + "}"  # past its region, or growing an empty one
        with pytest.raises(CheckpointError, match="damaged packed structure"):
            unpack(packed)


def test_writing_from_the_state_itself_gives_the_bytes_of_the_copied_layout(tmp_path, fp16_run):
    """Save writes each tensor's bytes straight into the file (no packed copy first): the same file."""
    state = odd_state() | {"run": capture(fp16_run.parts())}
    save_sealed(tmp_path / "copied.pth", pack(state))
    save_sealed(tmp_path / "direct.pth", packing(state))
    assert (tmp_path / "copied.pth").read_bytes() == (tmp_path / "direct.pth").read_bytes()
    assert_identical(state, load_sealed(tmp_path / "direct.pth"))


def test_a_zip_the_one_pass_reader_does_not_expect_is_verified_and_read_by_torch_load(tmp_path, monkeypatch):
    state = odd_state()
    save_sealed(tmp_path / "odd.pth", packing(state))
    monkeypatch.setattr(sealed, "_central_directory", lambda file, size: None)  # as for zip64 or compression
    assert_identical(state, load_sealed(tmp_path / "odd.pth"))
    data = bytearray((tmp_path / "odd.pth").read_bytes())
    data[len(data) // 2] ^= 0x01
    (tmp_path / "odd.pth").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_sealed(tmp_path / "odd.pth")


def test_a_wrapped_torch_save_and_load_see_the_state_itself(tmp_path, monkeypatch):
    """The doctor's tracer wraps torch.save and torch.load: it is given the state, in the first layout."""
    seen = []
    original_save, original_load = torch.save, torch.load

    def save(obj, f, *args, **kwargs):
        seen.append(("save", obj))
        return original_save(obj, f, *args, **kwargs)

    def load(f, *args, **kwargs):
        seen.append(("load", None))
        return original_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(torch, "load", load)
    state = {"format": "exactresume.resume", "version": 2, "model": {"w": torch.arange(4.0)}}
    save_sealed(tmp_path / "f.pth", packing(state))
    kind, saved = seen[0]
    assert kind == "save" and saved["model"]["w"] is state["model"]["w"] and saved["version"] == 1
    loaded = load_sealed(tmp_path / "f.pth")
    assert seen[-1] == ("load", None)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"]) and loaded["version"] == 1
