"""The small stateful parts of a loop that are not a model or an optimizer: the step, a torch.Generator,
and the global RNGs.

Each has `state_dict()` / `load_state_dict()` (PyTorch's `Stateful`: the protocol of torch's
optimizers, DCP and torchdata), so a checkpoint is just a table of named parts. A part whose state
differs between processes says so with `per_rank = True`. The loaders' parts are in exactresume.loaders.
"""

from __future__ import annotations

import random

import torch

from exactresume.errors import FieldError, a_kind_of


class StepCounter:
    """The global optimizer step; the lr schedule is a pure function of it."""

    def __init__(self, value: int = 0):
        self.value = value

    def state_dict(self) -> int:
        return self.value

    def load_state_dict(self, state: int) -> None:
        self.value = int(state)


class GeneratorPart:
    """A torch.Generator as a part: its state is the position of whatever it draws (batches, noise).

    Under many processes `per_rank=True` keeps every rank's state (each rank draws its own stream);
    the default saves rank 0's, for a generator every rank draws alike (the whole global batch).
    """

    def __init__(self, generator: torch.Generator, per_rank: bool = False):
        if not isinstance(generator, torch.Generator):
            raise FieldError(f"GeneratorPart takes a torch.Generator, got {a_kind_of(generator)}", "generator")
        self.generator, self.per_rank = generator, per_rank

    def state_dict(self) -> torch.Tensor:
        return self.generator.get_state()

    def load_state_dict(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


class GlobalRng:
    """torch (CPU and CUDA), numpy and python `random` states: dropout masks and any other draw.

    numpy's state is held where numpy is installed (the library does not need it); a file holding it
    loads where numpy is absent, without it. Each process has its own, so under many processes every
    rank's state is kept (`per_rank`)."""

    per_rank = True

    def state_dict(self) -> dict:
        version, internal, gauss_next = random.getstate()
        state = {
            "torch": torch.get_rng_state(),
            "cuda": _cuda_states(),
        }
        np = _numpy_or_none()
        if np is not None:
            kind, keys, position, has_gauss, cached_gauss = np.random.get_state()
            # numpy arrays would need an unpickling allow-list; tensors and ints do not.
            state["numpy"] = {
                "kind": kind,
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(position),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached_gauss),
            }
        state["python"] = {"version": version, "internal": list(internal), "gauss_next": gauss_next}
        return state

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        _restore_cuda(state["cuda"])
        np = _numpy_or_none() if "numpy" in state else None
        if np is not None:
            numpy_state = state["numpy"]
            np.random.set_state(
                (
                    numpy_state["kind"],
                    numpy_state["keys"].numpy().astype(np.uint32),
                    numpy_state["pos"],
                    numpy_state["has_gauss"],
                    numpy_state["cached_gaussian"],
                )
            )
        python_state = state["python"]
        random.setstate((python_state["version"], tuple(python_state["internal"]), python_state["gauss_next"]))


def _cuda_states() -> list[torch.Tensor]:
    """Each GPU's RNG state, where this process has started CUDA. One that has not cannot have drawn from
    it (a seed given before is applied when CUDA starts), and reading the states would start CUDA on every
    GPU: memory on each for a run on the CPU, from each of its processes."""
    return torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []


def _restore_cuda(states: list[torch.Tensor]) -> None:
    """The saved states of the GPUs this process sees: a GPU it does not see draws nothing here."""
    if states and torch.cuda.is_available():
        for device, state in enumerate(states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, device)


def _numpy_or_none():
    """numpy where it is installed, else None: without it no code can have drawn from its RNG."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy
