"""DCP's save plans kept from one sharded save to the next, while the state's layout stays the same.

Before it writes a byte, dcp.save has every rank list its items (1,400 a rank on the default
preset), gathers the lists on rank 0, which checks and merges them into the global plan and the
index, and sends each rank its part back: a tenth of a save of 20 MB here. DCP can keep the plans
(`DefaultSavePlanner(enable_plan_caching=True)`), but it files them under the planner's class name
and judges a rank's plan unchanged by its items' names, shapes and offsets alone: not their dtypes,
nor whether a flattened name `a.0` was a list's first item or a dict's key "0". A state cast to
bf16 between two saves would be indexed as fp32 still, and read back as such.

Here the plans are filed under a digest of all of that (`layout_digest`), on which the ranks agree
in one collective before the save: a plan is reused only when no rank's layout changed since the
save that made it, and any change, on any rank, plans afresh under a new key. Only the newest
layout's plans are kept. On a torch whose DCP cannot keep plans, every save plans afresh.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner

from exactresume.store.resume import is_dtensor
from exactresume.world import World

KEY_PREFIX = "exactresume.layout."
_KEEPS_PLANS = "enable_plan_caching" in inspect.signature(DefaultSavePlanner.__init__).parameters
# DCP's class-level stores of kept plans, each keyed by the planner's key (torch/distributed/checkpoint/planner.py)
_KEPT = ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata")


def planner_for(state: dict, world: World) -> DefaultSavePlanner:
    """The planner for a dcp.save of `state` by every rank of `world`: one that reuses the plans of the
    save before when every rank's layout is that save's. A collective: every rank calls it, and none
    returns before all have."""
    if not _KEEPS_PLANS:
        world.barrier()
        return DefaultSavePlanner()
    digest = layout_digest(state)
    if not world.agree(digest):
        return DefaultSavePlanner()
    key = f"{KEY_PREFIX}{digest:016x}"
    _forget_layouts_but(key)
    planner = DefaultSavePlanner(enable_plan_caching=True)
    planner._cached_plans_key = key  # DCP files kept plans under this name (its class's name by default)
    return planner


def layout_digest(state: Any) -> int:
    """A 62-bit digest of what a save plan holds of `state`: every value's path (a list's index and a
    dict's key told apart) and kind, and each tensor's dtype and shape, and for a DTensor how it is
    spread over the ranks (its placements over the mesh of ranks: which rows each rank holds).
    Values themselves are not in it: a plan names them, the save writes them."""
    hasher, meshes = xxhash.xxh3_64(), {}
    for path, layout in _layouts(state, (), meshes):
        hasher.update(repr((path, layout)).encode())
    return hasher.intdigest() >> 2  # |digest| and -digest fit an int64 (World.agree)


def _layouts(node: Any, path: tuple, meshes: dict[int, list]) -> Iterator[tuple[tuple, tuple]]:
    if isinstance(node, dict | list | tuple):
        yield path, (type(node).__name__, len(node))
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for step, value in items:
            yield from _layouts(value, (*path, step), meshes)
    elif not isinstance(node, torch.Tensor):
        yield path, (type(node).__name__,)
    elif is_dtensor(node):  # the mesh's ranks, not this rank's place in it: the ranks must agree on the digest
        mesh = node.device_mesh
        if id(mesh) not in meshes:
            meshes[id(mesh)] = mesh.mesh.tolist()
        ranks = meshes[id(mesh)]
        yield path, ("DTensor", node.dtype, node.shape, node.placements, ranks)
    else:
        yield path, ("Tensor", node.dtype, node.shape, node.layout)


def _forget_layouts_but(key: str) -> None:
    """Drop the plans DCP keeps for this module's other layouts (a state that changed, another store's)."""
    for name in _KEPT:
        kept = getattr(SavePlanner, name, {})
        for other in [other for other in kept if other.startswith(KEY_PREFIX) and other != key]:
            del kept[other]
