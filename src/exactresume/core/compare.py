"""Comparisons between runs: tensor by tensor, whole-model distances, loss and sample sequences."""

from __future__ import annotations

import torch

from exactresume.errors import UserError

StateDict = dict[str, torch.Tensor]


def tensor_differences(a: StateDict, b: StateDict) -> dict[str, float]:
    """Max abs difference per tensor name; a UserError if the two hold different names or shapes."""
    if a.keys() != b.keys():
        only = sorted(set(a) ^ set(b))
        raise UserError(f"the two files hold different tensors ({len(only)} names differ, e.g. {only[0]})")
    out = {}
    for name in a:
        if a[name].shape != b[name].shape:
            raise UserError(
                f"tensor {name} has shape {tuple(a[name].shape)} in one file and {tuple(b[name].shape)} in the other"
            )
        out[name] = (a[name].double() - b[name].double()).abs().max().item() if a[name].numel() else 0.0
    return out


def weight_distance(run: StateDict, reference: StateDict) -> dict[str, float]:
    """max_abs_diff over all tensors and rel_l2 = ||run - reference|| / ||reference|| (all weights as one vector)."""
    differences = tensor_differences(run, reference)
    squared_diff = sum(((run[k].double() - reference[k].double()) ** 2).sum().item() for k in reference)
    squared_ref = sum((reference[k].double() ** 2).sum().item() for k in reference)
    return {"max_abs_diff": max(differences.values()), "rel_l2": (squared_diff / squared_ref) ** 0.5}


def loss_differences(run: dict[int, str], reference: dict[int, str]) -> list[dict]:
    """Per step the run logged: its loss minus the reference's loss at the same step."""
    return [{"step": step, "diff": float(loss) - float(reference[step])} for step, loss in sorted(run.items())]


def repeated_batches(run: dict[int, list[int]], reference: dict[int, list[int]], before: int) -> int:
    """How many of `run`'s batches equal a batch the reference had already trained on by step `before`."""
    seen = {tuple(starts) for step, starts in reference.items() if step <= before}
    return sum(tuple(starts) in seen for starts in run.values())
