"""`exactresume diff`: the model weights of two files, folders or prefixes, compared bit for bit.

exactresume diff a.pth b.pth          exit 0: equal, 1: different
"""

from __future__ import annotations

import argparse

from exactresume.commands.output import emit
from exactresume.commands.places import add_s3_flags, any_location, check_endpoint_used, place


def tolerance(text: str) -> float:
    """--atol: a finite difference of 0 or more (no two values are within a negative one, nor NaN)."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a tolerance: 0 (the same bits) or a positive number")
    return value


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "a", type=any_location, metavar="A", help="a weights or resume file, sharded folder, or s3:// of one"
    )
    parser.add_argument("b", type=any_location, metavar="B", help="the one to compare A with")
    add_s3_flags(parser)
    parser.add_argument(
        "--atol",
        type=tolerance,
        default=0.0,
        help="largest difference of finite values still called equal (default 0: the same bits)",
    )
    one_of = parser.add_mutually_exclusive_group()
    one_of.add_argument("--quiet", action="store_true", help="print nothing: the exit code says equal (0) or not (1)")
    one_of.add_argument("--json", action="store_true", help="print the differences as one JSON object")


def run(args: argparse.Namespace) -> int:
    from exactresume.core.compare import tensor_differences
    from exactresume.store.weights import read_weights

    check_endpoint_used(args, args.a, args.b)
    differences = tensor_differences(read_weights(place(args.a, args))[0], read_weights(place(args.b, args))[0])
    unequal = {name: diff for name, diff in differences.items() if not diff.within(args.atol)}
    summary = {
        "command": "diff",
        "a": str(args.a),
        "b": str(args.b),
        "tensors": len(differences),
        "max_abs_diff": max((diff.max_abs for diff in differences.values()), default=0.0),  # over finite values
        "atol": args.atol,
        "equal": not unequal,
        "unequal": {name: {"max_abs_diff": diff.max_abs, "what": diff.describe()} for name, diff in unequal.items()},
        # NaN and Inf counted in (A, B): a non-finite value is equal only where its bits are.
        "nan": [sum(diff.nan[i] for diff in differences.values()) for i in (0, 1)],
        "inf": [sum(diff.inf[i] for diff in differences.values()) for i in (0, 1)],
    }
    emit(args, summary, render, gap=False)
    return 0 if summary["equal"] else 1


def render(summary: dict) -> list[str]:
    lines = [f"{value['max_abs_diff']:.3e}  {name}  ({value['what']})" for name, value in summary["unequal"].items()]
    notes = [f"{label} {a} in A, {b} in B" for label in ("NaN", "Inf") for a, b in [summary[label.lower()]] if a or b]
    scope = f" over finite values ({', '.join(notes)})" if notes else ""
    if summary["unequal"]:
        count = len(summary["unequal"])
        scope += f", {count} {'tensor' if count == 1 else 'tensors'} not equal"
    verdict = "equal" if summary["equal"] else "different"
    tensors, worst, atol = summary["tensors"], summary["max_abs_diff"], summary["atol"]
    return lines + [f"{tensors} tensors, max abs difference {worst:.3e}{scope}: {verdict} (atol {atol:g})"]
