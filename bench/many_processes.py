"""The lab on 1 and on 2 processes, timed, then each stopped run resumed on the other number.

    python bench/many_processes.py --data data/kjv --out runs/many    # lab-sized: 60 steps, batch 8, length 128
    cp runs/many/many_processes.json docs/ && python bench/many_processes.py --readme docs/many-processes.md

Writes OUT/many_processes.json: for 2 -> 1 and 1 -> 2 whether the resumed run saw the same samples
as the run it continues and its weight distance to it, the distance of the two straight runs, and
the N-independent mode's step time against plain DDP on 2 processes (bench/exact_mode.py), and
FSDP2's memory per rank and resumes on another N (bench/fsdp.py) — the figures of docs/many-processes.md, rendered
into its many-processes blocks from the copy in docs/; and OUT/timings.json, the two labs' wall
times. Same-N exactness is each lab's own compare.json.

    python bench/many_processes.py --data data/kjv --out runs/many --only fsdp   # FSDP2's figures only,
                                                          # the others kept from docs/many_processes.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from exactresume.config import TrainConfig
from exactresume.core.compare import weight_distance
from exactresume.core.steplog import read_samples
from exactresume.store.weights import read_weights


def exactresume(*args: object) -> float:
    """Run `exactresume ARGS` in a new process; its wall time in seconds."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "exactresume.cli", *map(str, args)], check=True)
    return time.perf_counter() - started


def resume_elsewhere(lab: Path, nproc: int, out: Path, data: Path) -> dict:
    """Resume `lab`'s stopped run on `nproc` processes; compare with that lab's straight run."""
    samples = out / "samples.csv"
    exactresume(
        "train", "--data", data, "--out", out, "--resume", lab / "resume.pth", "--nproc", nproc, "--samples", samples
    )
    straight = read_samples(lab / "details" / "straight_samples.csv")
    resumed = read_samples(samples)
    return {
        "same_samples": resumed == {step: straight[step] for step in resumed},
        "steps_resumed": len(resumed),
        **weight_distance(read_weights(out / "final.pth")[0], read_weights(lab / "straight.pth")[0]),
    }


ROOT = Path(__file__).resolve().parent.parent
DOCS_JSON = ROOT / "docs" / "many_processes.json"
BEGIN = "<!-- many-processes:begin (generated from docs/many_processes.json by bench/many_processes.py) -->"
END = "<!-- many-processes:end -->"
EXACT_BEGIN = "<!-- exact-mode:begin (generated from docs/many_processes.json by bench/many_processes.py) -->"
EXACT_END = "<!-- exact-mode:end -->"
FSDP_RESUMES = (
    "<!-- fsdp-resumes:begin (generated from docs/many_processes.json by bench/many_processes.py) -->",
    "<!-- fsdp-resumes:end -->",
)
FSDP_MEMORY = (
    "<!-- fsdp-memory:begin (generated from docs/many_processes.json by bench/many_processes.py) -->",
    "<!-- fsdp-memory:end -->",
)


def figures_json(
    two_to_one: dict, one_to_two: dict, straight_distance: dict, exact_mode: dict, steps: int, stop_at: int
) -> dict:
    """What many_processes.json holds (and docs/many_processes.json, which docs/many-processes.md's blocks render)."""

    def resumed(figures: dict) -> dict:
        keys = ("same_samples", "steps_resumed", "max_abs_diff", "rel_l2")
        return {key: figures[key] for key in keys}

    return {
        "steps": steps,
        "stop_at": stop_at,
        "batch": TrainConfig().batch,  # the lab's defaults, which both labs ran
        "seq_len": TrainConfig().seq_len,
        "two_to_one": resumed(two_to_one),
        "one_to_two": resumed(one_to_two),
        "straight_1_vs_2": {"max_abs_diff": straight_distance["max_abs_diff"]},
        "exact_mode": {
            "processes": exact_mode["processes"],
            "goal": exact_mode["goal"],
            **{key: ranged(exact_mode[key]) for key in ("per_rank_micro_batch", "one_sequence_micro_batch")},
        },
    }


def ranged(figure: dict) -> dict:
    return {key: figure[key] for key in ("ratio", "round_min", "round_max")}


def short(value: float) -> str:
    """Two significant digits, as docs/many-processes.md writes them: 1.4e-7."""
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def render(figures: dict) -> str:
    """The page's sentences about resuming on another N, from many_processes.json."""
    two, one, straight = figures["two_to_one"], figures["one_to_two"], figures["straight_1_vs_2"]
    same = "the same samples at every step" if two["same_samples"] and one["same_samples"] else "other samples"
    return (
        f"{two['steps_resumed']} resumed steps of batch {figures['batch']} × {figures['seq_len']}) "
        f"the resumed weights\n  differ from the uninterrupted run by **{short(two['max_abs_diff'])}** max abs "
        f"for 2 -> 1 (relative L2 {short(two['rel_l2'])}) and\n  {short(one['max_abs_diff'])} for 1 -> 2 "
        f"({short(one['rel_l2'])}), with {same}. Two whole runs on 1 and on 2\n  processes from step 0 differ "
        f"by {short(straight['max_abs_diff'])} after {figures['steps']} steps"
    )


def render_exact(figures: dict) -> str:
    """The page's sentence about the N-independent mode's cost, from many_processes.json."""
    exact = figures["exact_mode"]
    per_rank, per_sequence = exact["per_rank_micro_batch"], exact["one_sequence_micro_batch"]
    return (
        f"on {exact['processes']} processes the step time with one micro-batch per rank (B = 4, DDP's own\n"
        f"  shapes) is **{per_rank['ratio']:.2f}×** plain DDP's (rounds {per_rank['round_min']:.2f}–"
        f"{per_rank['round_max']:.2f}; goal {exact['goal']}), and with one sequence per micro-batch (B = 1)\n"
        f"  {per_sequence['ratio']:.2f}× ({per_sequence['round_min']:.2f}–{per_sequence['round_max']:.2f})"
    )


def render_fsdp_resumes(figures: dict) -> str:
    """The page's sentence about FSDP2's resumes on the same and on another N."""
    resumes = figures["fsdp"]["resumes"]
    same = resumes["two_to_two"]
    names = {"two_to_one": "2 -> 1", "two_to_four": "2 -> 4", "one_to_two": "1 -> 2"}
    moved = [(name, resumes[key]) for key, name in names.items()]
    samples = "the same samples at every step" if all(r["same_samples"] for _, r in moved) else "other samples"
    ends = "**bit-identical** to" if same["bit_identical"] else "differing from"
    distances = ", ".join(f"{short(r['max_abs_diff'])} for {name}" for name, r in moved)
    return (
        f"stopped at {resumes['stop_at']} of {resumes['steps']} steps (batch {resumes['batch']} × "
        f"{resumes['seq_len']}) and resumed on 2 processes, the run ends {ends} the\n  uninterrupted one; "
        f"resumed on another N it differs from it by {distances} (max abs),\n  with {samples}. "
        f"Whole runs on 1 and on 2 processes differ by {short(resumes['straight_1_vs_2']['max_abs_diff'])}, "
        "for the reason given for DDP above"
    )


def render_fsdp_memory(figures: dict) -> str:
    """The page's table of FSDP2's memory per rank."""
    rows = [
        "| processes | mode | glibc malloc | weights | gradients | AdamW state | after set-up | peak in training |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rank in figures["fsdp"]["memory"]["per_rank"]:
        mode = "FSDP2" if rank["shard"] == "fsdp" else "DDP"
        keys = ("weights_bytes", "gradient_bytes", "optimizer_bytes", "setup_rss_bytes", "training_peak_rss_bytes")
        sizes = " | ".join(f"{rank[key] / 1e6:,.0f} MB" for key in keys)
        malloc = f"`{rank['malloc']}`" if rank["malloc"] else "default"
        rows.append(f"| {rank['processes']} | {mode} | {malloc} | {sizes} |")
    return "\n\n  " + "\n  ".join(rows) + "\n\n  "  # indented: the table sits inside a list item


def update_readme(readme: Path, figures: dict) -> None:
    text = readme.read_text()
    blocks = [(BEGIN, END, render(figures)), (EXACT_BEGIN, EXACT_END, render_exact(figures))]
    if "fsdp" in figures:
        blocks += [(*FSDP_RESUMES, render_fsdp_resumes(figures)), (*FSDP_MEMORY, render_fsdp_memory(figures))]
    for begin, end, block in blocks:
        start, stop = text.index(begin) + len(begin), text.index(end)
        text = text[:start] + block + text[stop:]
    readme.write_text(text)


def measure(data: Path, out: Path) -> dict:
    labs = {n: out / f"lab{n}" for n in (1, 2)}
    wall = {
        f"lab_nproc{n}_s": exactresume("lab", "--data", data, "--out", folder, "--nproc", n)
        for n, folder in labs.items()
    }
    (out / "timings.json").write_text(json.dumps(wall | {"ratio": wall["lab_nproc2_s"] / wall["lab_nproc1_s"]}) + "\n")
    compare = json.loads((labs[1] / "compare.json").read_text())
    subprocess.run([sys.executable, "-m", "bench.exact_mode", "--data", str(data), "--out", str(out)], check=True)
    return figures_json(
        resume_elsewhere(labs[2], 1, out / "two_to_one", data),
        resume_elsewhere(labs[1], 2, out / "one_to_two", data),
        weight_distance(read_weights(labs[1] / "straight.pth")[0], read_weights(labs[2] / "straight.pth")[0]),
        json.loads((out / "exact_mode.json").read_text()),
        steps=compare["steps"],
        stop_at=compare["stop_at"],
    ) | {"fsdp": measure_fsdp(data, out / "fsdp")}


def measure_fsdp(data: Path, out: Path) -> dict:
    """bench/fsdp.py's figures, measured in processes of their own (as bench.exact_mode's are)."""
    subprocess.run([sys.executable, "-m", "bench.fsdp", "--data", str(data), "--out", str(out)], check=True, cwd=ROOT)
    return json.loads((out / "fsdp.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("data/kjv"))
    parser.add_argument("--out", type=Path, default=Path("runs/many"))
    parser.add_argument(
        "--readme", type=Path, help="measure nothing: rewrite this page's blocks from docs/ (docs/many-processes.md)"
    )
    parser.add_argument("--only", choices=("fsdp",), help="measure FSDP2's figures only; keep the rest from docs/")
    args = parser.parse_args()
    if args.readme:
        update_readme(args.readme, json.loads(DOCS_JSON.read_text()))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only:
        figures = json.loads(DOCS_JSON.read_text()) | {"fsdp": measure_fsdp(args.data, args.out / "fsdp")}
    else:
        figures = measure(args.data, args.out)
    (args.out / "many_processes.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
