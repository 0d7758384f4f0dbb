"""`--shard fsdp`: each rank holds 1/N of the weights, gradients and AdamW state (PyTorch's FSDP2).

Every decoder block, then the whole model, is wrapped with `fully_shard` on a one-dimensional CPU
mesh (gloo), so a parameter is a DTensor whose local shard is rank r's rows. The forward and
backward gather a block's weights just before it runs and free them after; the backward
reduce-scatters each gradient, so a rank only ever holds its shard of the mean gradient, and
AdamW updates only its shard. The samples are the DDP path's: every rank draws the global batch
and trains on its contiguous slice (replicas.Replicas.local), so a step's samples do not depend
on N. On one process the model is left unwrapped: FSDP2 over one rank is the plain model.

Files: the resume state goes to DCP (a sharded folder, each rank writing its own shards, which
DCP reshards on load for any N). A single file (a periodic checkpoint, the final weights) holds
the full state, gathered from every rank (`full_parts`, `full_model_state`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from exactresume.parallel.replicas import DataParallel
from exactresume.world import World

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

# FSDP2 and DCP's state-dict helpers take half a second to import; a run without --shard fsdp never does.
FSDP_MODULE = "torch.distributed.fsdp"


def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered whole, on the CPU


class ShardedReplicas(DataParallel):
    """The run's model under FSDP2: this rank's slice of a batch, its loss, gradients reduce-scattered."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        super().__init__(world)
        names = {id(param): name for name, param in model.named_parameters()}
        mesh = init_device_mesh("cpu", (world.size,))
        for block in model.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)  # the root: embeddings (tied to the head), final norm
        # The loop calls model.loss, not model(): FSDP must gather the root's weights around it too.
        register_fsdp_forward_method(model, "loss")
        self.loss = model.loss
        _point_at_new_parameters(optimizer, names, dict(model.named_parameters()))


def _point_at_new_parameters(optimizer: torch.optim.Optimizer, names: dict[int, str], new: dict) -> None:
    """fully_shard replaces each parameter with a sharded one: the optimizer must update those instead.

    The optimizer is still fresh (a resume is restored after the model is wrapped), so it holds
    no state keyed by the old parameters; its groups are pointed at the new ones by name.
    """
    if optimizer.state:
        raise RuntimeError("the model must be sharded before the optimizer takes its first step or is restored")
    for group in optimizer.param_groups:
        group["params"] = [new[names[id(param)]] for param in group["params"]]


def _is_sharded(model: torch.nn.Module) -> bool:
    """True for a model wrapped by FSDP2 (its parameters are DTensors)."""
    fsdp = sys.modules.get(FSDP_MODULE)  # no model is wrapped before FSDP2 is imported
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole state dict as plain CPU tensors; every rank must call it (it gathers)."""
    if not _is_sharded(model):
        return model.state_dict()
    return _tied_as_in(model, FullModel(model).state_dict())


def _tied_as_in(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with the names of one shared parameter (lm_head and the embedding) holding one tensor,
    as an unsharded model's state dict does: the gather copies each name apart, and the weights file
    would store the tied matrix twice."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(param), name)
        if owner != name and owner in state and name in state:
            state[name] = state[owner]
    return state


class FullModel:
    """The model part of a single file: gathered whole when saved, cut into this rank's shards when loaded."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model, options=_full_options())

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))


class FullOptimizer:
    """The optimizer part of a single file, keyed by parameter names: whole when saved, sharded when loaded."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer, options=_full_options())

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(self.model, self.optimizer, state, options=options)


def full_parts(parts: Mapping[str, Stateful], fsdp: bool) -> dict[str, Stateful]:
    """`parts` as a single file of an `fsdp` run holds them: the model and optimizer gathered whole.

    The optimizer is keyed by parameter names, as DCP keys it, on any N: on one process too, where
    the model is not wrapped, so that a checkpoint of 2 ranks resumes on 1 and the other way round.
    """
    if not fsdp:
        return dict(parts)
    model = parts["model"]
    return dict(parts) | {"model": FullModel(model), "optimizer": FullOptimizer(model, parts["optimizer"])}


def shard_destinations(model: torch.nn.Module) -> Callable[[tuple, torch.Size], Any] | None:
    """Where DCP should read a saved tensor into, so that each rank reads only its own shard.

    A model weight, or an optimizer state tensor of a weight's shape (AdamW's moments), is read into
    an empty DTensor laid out as that weight is on this run's mesh; DCP then reads, from whatever
    layout the folder was saved in, just the rows this rank holds. Anything else (a saved shape
    that no longer matches, the step counts, the other parts) is read whole: a changed model is
    then refused by the config check, with its reason, instead of by DCP mid-read.
    """
    if not _is_sharded(model):
        return None
    from torch.distributed.tensor import DTensor

    weights = {name: value for name, value in model.state_dict().items() if isinstance(value, DTensor)}

    def destination(path: tuple, saved_shape: torch.Size) -> torch.Tensor | None:
        name = _weight_named_by(path)
        like = weights.get(name) if name is not None else None
        if like is None or like.shape != saved_shape:
            return None
        return torch.empty_like(like)

    return destination


def _weight_named_by(path: tuple) -> str | None:
    """The weight a saved path belongs to: ("model", NAME) or ("optimizer", "state", NAME, moment)."""
    if len(path) == 2 and path[0] == "model":
        return path[1]
    if len(path) == 4 and path[:2] == ("optimizer", "state"):
        return path[2]
    return None
