"""The packed layout: a nested state's tensors as a few byte buffers and its structure as one JSON string.

torch.load's `weights_only` unpickler is pure Python, and it pays for every record of a pickle: each
tensor (a storage record, a rebuild call, its size and stride tuples) and each Python object. A
resume file of the default preset holds about 190 tensors and 1,000 small values, so that cost is
most of its load. `pack` turns the state into a dict of five records instead:

    {"format": ..., "version": ..., "layout": "packed",
     "structure": JSON text of the nested state, tensors replaced by references,
     "storages": [one uint8 tensor per top-level part that holds tensors]}

and `unpack` rebuilds the exact nested state from it. The file stays a plain torch file:

    exactresume.store.packed.unpack(torch.load(path, weights_only=True))   # the nested state

Every reader of our files gets the nested state through `unpack` (sealed.load_sealed calls it), so
a file in the older layout, one record per tensor, reads as it always did: `unpack` returns any
object that is not packed unchanged.

What is kept, bit for bit: dicts (with keys of any JSON-able kind: the optimizer's int keys stay
ints), OrderedDicts with their attributes (a state dict's `_metadata`), lists, tuples, torch.Size,
strings, bytes, ints, floats, bools, None, dtypes, and tensors of any dtype, shape and stride. A
tensor is a view (offset, shape, stride) into a region; a region is the bytes of one storage of the
packed state, so tensors that shared a storage (tied weights, views) share one again and any others
never overlap. Each region is its own storage on loading (a slice of its part's buffer, no copy), as
torch.load would give it, so the optimizer can write its state in place. Tensors on other devices
are stored from CPU copies and load on the CPU, as `torch.load(map_location="cpu")` loads them.

Writing copies nothing: `packing(state)` lays the state out with placeholder buffers (allocated,
never touched) and `Packing.pieces` yields each buffer's bytes from the state's own tensors, which
sealed.write_sealed writes where torch.save writes a placeholder. `pack(state)` is the same layout
with the bytes copied into real buffers, for a caller that wants to torch.save it itself. Each
region starts at a multiple of 64 bytes and the gaps are zeros, so the same state gives the same file.
Memory on loading: a part's buffer lives while any of its tensors does (the optimizer keeps its own
part's), and a part whose tensors are all copied elsewhere (the model's, by load_state_dict) is freed.
"""

from __future__ import annotations

import contextlib
import gc
import json
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from exactresume.errors import CheckpointError

LAYOUT = "packed"
FIRST_LAYOUT_VERSION = 1  # formats.RESUME_VERSIONS[0]: one pickle record per tensor
ALIGNMENT = 64  # each region starts at a multiple of 64 bytes: aligned for any dtype's view
DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in vars(torch).values() if isinstance(dtype, torch.dtype)}
DTYPE_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in DTYPES.values()}  # torch's own names, no aliases
SLICE = torch._C.StorageBase.__getitem__
UNGROUPED = ""  # the buffer of tensors not under a top-level key (a state that is not a dict)


def is_packed(obj: object) -> bool:
    """Whether `obj` is a loaded file in the packed layout."""
    return isinstance(obj, dict) and obj.get("layout") == LAYOUT


class _Packer:
    """One walk of the state: the JSON-able structure, and the distinct storages it references."""

    def __init__(self) -> None:
        self.regions: list[int] = []  # buffer index, byte offset, bytes: three numbers per distinct storage
        self.sources: list[torch.UntypedStorage] = []
        self.buffers: dict[str, int] = {}  # group name -> buffer index
        self.ends: list[int] = []  # bytes used so far in each buffer
        self.seen: dict[tuple, int] = {}  # storage identity -> region index

    def node(self, value: Any, group: str) -> Any:
        kind = type(value)
        if value is None or kind in (str, int, float, bool):
            return value
        if kind is torch.Tensor:
            return self.tensor(value, group)
        if kind is dict and all(type(key) is str for key in value):
            return {key: self.node(item, group) for key, item in value.items()}
        if kind is dict:
            return ["dict", *([self.node(key, group), self.node(item, group)] for key, item in value.items())]
        if kind is OrderedDict:
            pairs = [[self.node(key, group), self.node(item, group)] for key, item in value.items()]
            return ["ordered_dict", pairs, self.node(dict(vars(value)), group)]
        if kind in (list, tuple, torch.Size):
            return [SEQUENCE_TAGS[kind], *(self.node(item, group) for item in value)]
        if kind is bytes:
            return ["bytes", value.hex()]
        if kind is torch.dtype:
            return ["dtype", str(value).removeprefix("torch.")]
        raise TypeError(f"cannot pack a {kind.__module__}.{kind.__qualname__} into a resume file")

    def tensor(self, tensor: torch.Tensor, group: str) -> list:
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_conj() or tensor.is_neg():
            raise TypeError(f"cannot pack a tensor of layout {tensor.layout} (or with a lazy conj/neg bit)")
        device = tensor.device
        if device.type == "meta":
            raise TypeError("cannot pack a meta tensor: it has no data")
        region = self.region(tensor.untyped_storage(), device, group)
        node = ["tensor", region, DTYPE_NAMES[tensor.dtype], tensor.storage_offset(), list(tensor.shape)]
        if tensor.requires_grad or not tensor.is_contiguous():  # contiguous strides follow from the shape
            node.append(list(tensor.stride()))
            if tensor.requires_grad:
                node.append(True)
        return node

    def region(self, storage: torch.UntypedStorage, device: torch.device, group: str) -> int:
        nbytes = storage.nbytes()
        identity = (device, storage.data_ptr(), nbytes)
        if nbytes and identity in self.seen:
            return self.seen[identity]
        buffer = self.buffers.get(group)
        if buffer is None:
            buffer = self.buffers[group] = len(self.ends)
            self.ends.append(0)
        start = -(-self.ends[buffer] // ALIGNMENT) * ALIGNMENT
        self.ends[buffer] = start + nbytes
        self.regions += [buffer, start, nbytes]
        self.sources.append(storage)
        self.seen[identity] = len(self.sources) - 1
        return len(self.sources) - 1

    def pieces(self, buffer: int) -> Iterator[torch.Tensor]:
        """Buffer `buffer`'s bytes in order, as CPU uint8 tensors: each region's storage, zeros between."""
        end = 0
        for index, source in enumerate(self.sources):
            where, start, nbytes = self.regions[3 * index : 3 * index + 3]
            if where != buffer:
                continue
            if start > end:  # the alignment gap: the same bytes every save
                yield torch.zeros(start - end, dtype=torch.uint8)
            if nbytes:
                as_bytes = torch.empty(0, dtype=torch.uint8, device=source.device).set_(source)
                yield as_bytes if as_bytes.device.type == "cpu" else as_bytes.cpu()
            end = start + nbytes


SEQUENCE_TAGS = {list: "list", tuple: "tuple", torch.Size: "size"}


@dataclass(frozen=True)
class Packing:
    """A state laid out for writing without copying it first.

    `layout` is what torch.save pickles, but its buffers are placeholders: memory allocated and never
    touched. A writer that meets a placeholder's bytes writes `pieces(index)` in their place, straight
    from the state's own tensors (sealed.write_sealed does), so the file is the one `pack` would give."""

    layout: dict
    placeholders: list[torch.Tensor]
    packer: _Packer
    state: Any  # what is laid out

    def unpacked(self) -> Any:
        """The state itself, marked as the layout before packing (version 1): for a reader that must see it."""
        has_version = isinstance(self.state, dict) and "version" in self.state
        return self.state | {"version": FIRST_LAYOUT_VERSION} if has_version else self.state

    def pieces(self, index: int) -> Iterator[torch.Tensor]:
        return self.packer.pieces(index)

    def filled(self) -> dict:
        """The layout with real buffers: each region's bytes copied in."""
        buffers = [torch.empty_like(placeholder) for placeholder in self.placeholders]
        for index, buffer in enumerate(buffers):
            done = 0
            for piece in self.pieces(index):
                buffer[done : done + piece.numel()].copy_(piece)
                done += piece.numel()
        return self.layout | {"storages": buffers}


def packing(state: Any) -> Packing:
    """`state` laid out for writing (its "format" and "version", when it has them, stay readable keys)."""
    packer = _Packer()
    if type(state) is dict and all(type(key) is str for key in state):
        structure = {key: packer.node(value, key) for key, value in state.items()}
    else:
        structure = packer.node(state, UNGROUPED)
    header = {key: state[key] for key in ("format", "version") if isinstance(state, dict) and key in state}
    text = json.dumps({"regions": packer.regions, "state": structure}, separators=(",", ":"))
    placeholders = [torch.empty(end, dtype=torch.uint8) for end in packer.ends]
    return Packing(
        header | {"layout": LAYOUT, "structure": text, "storages": placeholders}, placeholders, packer, state
    )


def pack(state: Any) -> dict:
    """`state` in the packed layout, as a dict torch.save can write (the tensors' bytes copied once)."""
    return packing(state).filled()


class _Unpacker:
    """The nested state back from the structure, each tensor a view into its region's storage."""

    def __init__(self, regions: list[int], buffers: list[torch.UntypedStorage]):
        self.regions, self.buffers = regions, buffers
        self.storages: dict[int, torch.UntypedStorage] = {}  # region index -> its storage, made on first use
        self.blanks: dict[str, torch.Tensor] = {}  # dtype name -> an empty tensor: new_empty is the cheap way

    def storage(self, region: int) -> torch.UntypedStorage:
        """The region as a storage of its own, as torch.load gives each storage (no copy): a tensor on
        it reaches nothing outside the region, and tensors of different regions never share one."""
        buffer, start, nbytes = self.regions[3 * region : 3 * region + 3]
        if not (0 <= buffer < len(self.buffers) and 0 <= start and start + nbytes <= self.buffers[buffer].nbytes()):
            raise CheckpointError(f"packed region {region} lies outside its buffer")
        # The C slice itself: UntypedStorage.__getitem__ only adds a check for meta storages, at
        # several times the cost, and these buffers are on the CPU. A slice cannot be resized, so no
        # shape or stride in the structure makes a tensor reach past its region (torch refuses it).
        storage = SLICE(self.buffers[buffer], slice(start, start + nbytes))
        self.storages[region] = storage
        return storage

    def node(self, node: Any) -> Any:
        if type(node) is dict:
            return {key: self.node(item) if type(item) in NESTED else item for key, item in node.items()}
        if type(node) is not list:
            return node
        tag, rest = node[0], node[1:]
        if tag == "tensor":
            return self.tensor(*rest)
        if tag in ("list", "tuple", "size"):
            items = [self.node(item) if type(item) in NESTED else item for item in rest]
            return items if tag == "list" else tuple(items) if tag == "tuple" else torch.Size(items)
        if tag == "dict":
            return {self.node(key): self.node(item) for key, item in rest}
        if tag == "ordered_dict":
            ordered = OrderedDict((self.node(key), self.node(item)) for key, item in rest[0])
            vars(ordered).update(self.node(rest[1]))
            return ordered
        if tag == "bytes":
            return bytes.fromhex(rest[0])
        if tag == "dtype":
            return _dtype(rest[0])
        raise CheckpointError(f"unknown node {str(tag)[:40]!r} in a packed structure")

    def tensor(self, region: int, dtype: str, offset: int, shape: list, stride: list | None = None, grad=False):
        blank = self.blanks.get(dtype)
        if blank is None:
            blank = self.blanks[dtype] = torch.empty(0, dtype=_dtype(dtype))
        storage = self.storages.get(region)
        if storage is None:
            storage = self.storage(region)
        if stride is None:  # contiguous: set_ computes the strides
            return blank.new_empty(0).set_(storage, offset, shape)
        tensor = blank.new_empty(0).set_(storage, offset, shape, stride)
        return tensor.requires_grad_() if grad else tensor


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise CheckpointError(f"unknown dtype {str(name)[:40]!r} in a packed structure")
    return DTYPES[name]


NESTED = (dict, list)  # the JSON nodes that hold others (or, as lists, stand for a tensor or a tuple)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """No cyclic garbage collection while the structure is built.

    Decoding and rebuilding make about a thousand fresh containers, none in a cycle; every few hundred
    would start a collection, and an older generation's walks every object of the interpreter
    (torch's own included): time that depends on the process, not on the file."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def unpack(obj: Any) -> Any:
    """The nested state a loaded packed file holds; any other object unchanged."""
    if not is_packed(obj):
        return obj
    try:
        with _collector_paused():
            return _unpack(obj)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as error:
        raise CheckpointError(f"a damaged packed structure ({type(error).__name__}: {str(error)[:200]})") from None


def _unpack(obj: dict) -> Any:
    structure = json.loads(obj["structure"])
    buffers = [tensor.untyped_storage() for tensor in obj["storages"]]
    return _Unpacker(structure["regions"], buffers).node(structure["state"])
