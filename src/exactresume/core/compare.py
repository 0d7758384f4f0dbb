"""Comparisons between runs: tensor by tensor, whole-model distances, loss and sample sequences.

Two tensors are identical when their bits are: both are read as integers of the same width, so a
NaN equals only a NaN with the same payload and -0.0 differs from +0.0. The largest difference is
taken over the values finite in both; NaN and Inf are counted by name, never dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from exactresume.errors import UserError

StateDict = dict[str, torch.Tensor]
_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class TensorDiff:
    """How two tensors of one name differ; `nan` and `inf` count the values in (first, second)."""

    numel: int
    max_abs: float  # largest |a - b| over the values finite in both (0.0 when there are none)
    bits_differ: int  # values whose bits differ (every value when the dtypes differ)
    nonfinite_differ: int  # of those, values that are NaN or Inf in either tensor
    signed_zeros: int  # of those, a zero against a zero of the other sign
    nan_payloads: int  # of those, a NaN against a NaN with other bits
    nan: tuple[int, int]
    inf: tuple[int, int]
    dtypes: tuple[str, str]

    @property
    def identical(self) -> bool:
        return self.bits_differ == 0

    def within(self, atol: float) -> bool:
        """Equal at tolerance `atol`: bit for bit at 0; above 0, finite values within atol, the rest bit for bit."""
        return self.identical or (atol > 0 and self.nonfinite_differ == 0 and self.max_abs <= atol)

    def describe(self) -> str:
        """'N of M values differ in bits: ...', naming NaN, Inf, signed zeros and dtypes."""
        if self.identical:
            return "bit-identical"
        notes = [f"dtype {self.dtypes[0]} against {self.dtypes[1]}"] if self.dtypes[0] != self.dtypes[1] else []
        for kind, (first, second) in (("NaN", self.nan), ("Inf", self.inf)):
            if first or second:
                notes.append(f"{kind} {first} in A, {second} in B")
        if self.nan_payloads:
            notes.append(f"{self.nan_payloads} NaN with another payload")
        if self.signed_zeros:
            notes.append(f"{self.signed_zeros} zero of the other sign")
        detail = f": {'; '.join(notes)}" if notes else ""
        return f"{self.bits_differ} of {self.numel} values differ in bits{detail}"


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers of its element width (bool as int8)."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bool:
        return tensor.to(torch.int8)
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    return tensor.view(_SAME_WIDTH_INT[tensor.element_size()])


def _counts(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not (tensor.is_floating_point() or tensor.is_complex()):
        false = torch.zeros(tensor.shape, dtype=torch.bool)
        return false, false
    return torch.isnan(tensor), torch.isinf(tensor)


def tensor_diff(a: torch.Tensor, b: torch.Tensor) -> TensorDiff:
    """Bit-for-bit comparison of two tensors of the same shape."""
    a, b = a.detach().cpu(), b.detach().cpu()
    (nan_a, inf_a), (nan_b, inf_b) = _counts(a), _counts(b)
    nonfinite = nan_a | inf_a | nan_b | inf_b
    same_dtype = a.dtype == b.dtype
    differ = bits(a) != bits(b) if same_dtype else torch.ones(a.shape, dtype=torch.bool)
    wide_a, wide_b = a.double(), b.double()
    finite_gap = (wide_a - wide_b).abs()[~nonfinite]
    return TensorDiff(
        numel=a.numel(),
        max_abs=finite_gap.max().item() if finite_gap.numel() else 0.0,
        bits_differ=int(differ.sum()),
        nonfinite_differ=int((differ & nonfinite).sum()),
        signed_zeros=int(((wide_a == 0) & (wide_b == 0) & (wide_a.signbit() != wide_b.signbit())).sum()),
        nan_payloads=int((differ & nan_a & nan_b).sum()) if same_dtype else 0,
        nan=(int(nan_a.sum()), int(nan_b.sum())),
        inf=(int(inf_a.sum()), int(inf_b.sum())),
        dtypes=(str(a.dtype).removeprefix("torch."), str(b.dtype).removeprefix("torch.")),
    )


def _check_same_layout(a: StateDict, b: StateDict) -> None:
    """A UserError if the two hold different names or shapes."""
    if a.keys() != b.keys():
        only = sorted(set(a) ^ set(b))
        raise UserError(f"the two files hold different tensors ({len(only)} names differ, e.g. {only[0]})")
    for name in a:
        if a[name].shape != b[name].shape:
            raise UserError(
                f"tensor {name} has shape {tuple(a[name].shape)} in one file and {tuple(b[name].shape)} in the other"
            )


def tensor_differences(a: StateDict, b: StateDict) -> dict[str, TensorDiff]:
    """Each tensor name's TensorDiff; a UserError if the two hold different names or shapes."""
    _check_same_layout(a, b)
    return {name: tensor_diff(a[name], b[name]) for name in a}


def identical(a: StateDict, b: StateDict) -> bool:
    """The same names, shapes, dtypes and bits."""
    _check_same_layout(a, b)
    return all(a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k])) for k in a)


def weight_distance(run: StateDict, reference: StateDict) -> dict[str, float]:
    """max_abs_diff over all tensors (NaN when a NaN or Inf differs) and rel_l2 = ||run - ref|| / ||ref||.

    Called after every step by --divergence, so the bit-for-bit comparison runs only for a tensor
    whose difference is not finite (a NaN or an Inf in it).
    """
    _check_same_layout(run, reference)
    max_abs, squared_diff, squared_ref = 0.0, 0.0, 0.0
    for name, ref in reference.items():
        wide_ref = ref.double()
        delta = run[name].double() - wide_ref
        worst = delta.abs().max().item() if delta.numel() else 0.0
        if not math.isfinite(worst):
            diff = tensor_diff(run[name], ref)
            worst = float("nan") if diff.nonfinite_differ else diff.max_abs
        max_abs = largest([max_abs, worst])
        squared_diff += (delta**2).sum().item()
        squared_ref += (wide_ref**2).sum().item()
    return {"max_abs_diff": max_abs, "rel_l2": (squared_diff / squared_ref) ** 0.5}


def largest(values) -> float:
    """max() that a NaN anywhere makes NaN (Python's max keeps a NaN only when it comes first); 0.0 if empty."""
    values = [float(value) for value in values]
    return float("nan") if any(math.isnan(value) for value in values) else max(values, default=0.0)


def loss_differences(run: dict[int, str], reference: dict[int, str]) -> list[dict]:
    """Per step the run logged: its loss minus the reference's loss at the same step."""
    return [{"step": step, "diff": float(loss) - float(reference[step])} for step, loss in sorted(run.items())]


def repeated_batches(run: dict[int, list[int]], reference: dict[int, list[int]], before: int) -> int:
    """How many of `run`'s batches equal a batch the reference had already trained on by step `before`."""
    seen = {tuple(starts) for step, starts in reference.items() if step <= before}
    return sum(tuple(starts) in seen for starts in run.values())
