"""The lab on 1 and on 2 processes, timed, then each stopped run resumed on the other number.

    python bench/many_processes.py --data data/kjv --out runs/many    # lab-sized: 60 steps, batch 8, length 128

Writes OUT/many_processes.json: the two labs' wall times (and their ratio, measured in this one
command), and for 2 -> 1 and 1 -> 2 whether the resumed run saw the same samples as the run it
continues and the max abs weight difference to it. Same-N exactness is each lab's own compare.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from exactresume.core.compare import weight_distance
from exactresume.store.steplog import read_samples
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("data/kjv"))
    parser.add_argument("--out", type=Path, default=Path("runs/many"))
    args = parser.parse_args()
    labs = {n: args.out / f"lab{n}" for n in (1, 2)}
    wall = {
        f"lab_nproc{n}_s": exactresume("lab", "--data", args.data, "--out", folder, "--nproc", n)
        for n, folder in labs.items()
    }
    figures = {
        **wall,
        "lab_nproc2_over_nproc1": wall["lab_nproc2_s"] / wall["lab_nproc1_s"],
        "two_to_one": resume_elsewhere(labs[2], 1, args.out / "two_to_one", args.data),
        "one_to_two": resume_elsewhere(labs[1], 2, args.out / "one_to_two", args.data),
        "straight_1_vs_2": weight_distance(
            read_weights(labs[1] / "straight.pth")[0], read_weights(labs[2] / "straight.pth")[0]
        ),
    }
    for n, folder in labs.items():
        figures[f"lab_nproc{n}_resumed_max_abs_diff"] = json.loads((folder / "compare.json").read_text())["runs"][
            "resumed"
        ]["max_abs_diff"]
    (args.out / "many_processes.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
