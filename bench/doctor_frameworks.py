"""The doctor's costs on the framework scripts of tests/doctor_scripts (Hugging Face's Trainer,
Accelerate, Lightning): the tracer's per-step overhead, and the doctor's wall time against one
straight run of the same command; bench/doctor_costs.py writes them into docs/doctor_costs.json.

Per step: each script runs STEPS steps in a fresh process, with a bare optimizer-step hook that
only reads the clock (plain), or with the whole tracer installed as the doctor installs it
(traced); plain and traced processes alternate, and the per-step time of each is the median of
the intervals between its optimizer steps after the first few. Wall: `exactresume doctor --steps 8
--stop-after 4` on the script, and the same with --warm, against one plain run of it for 8 steps,
alternated as well.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "tests" / "doctor_scripts"
FRAMEWORK_SCRIPTS = ("hf_trainer", "accelerate_loop", "lightning_checkpoint")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

# Runs the script in this process, the clock read at every optimizer step; with TRACED, under the tracer.
TIMED = """
import os, runpy, sys, time, json, torch
from torch.optim.optimizer import register_optimizer_step_post_hook
times = []
register_optimizer_step_post_hook(lambda optimizer, args, kwargs: times.append(time.perf_counter()))
if os.environ.get("TRACED"):
    from exactresume.doctor.tracer.hooks import Tracer
    from exactresume.doctor.tracer.install import install
    install(Tracer(os.environ["TRACED"], limit=10**9, crash_from=None))
script, out, sys.argv = sys.argv[1], sys.argv[2], sys.argv[1:2] + sys.argv[3:]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    open(out, "w").write(json.dumps(times))
"""


def step_seconds(script: str, steps: int, traced: bool, folder: Path) -> float:
    """Median seconds between optimizer steps (after the first five) in one fresh process."""
    env = os.environ | OFFLINE
    folder.mkdir(parents=True, exist_ok=True)
    if traced:
        env["TRACED"] = str(folder / "trace")
    times = folder / "times.json"
    args = [str(SCRIPTS / f"{script}.py"), str(times), "--out", str(folder / "out"), "--steps", str(steps)]
    subprocess.run(
        [sys.executable, "-c", TIMED, *args, "--save-every", str(10**6)], env=env, check=True, capture_output=True
    )
    clock = json.loads(times.read_text())
    return statistics.median(b - a for a, b in zip(clock[5:], clock[6:]))


def wall_seconds(command: list[str]) -> float:
    started = time.perf_counter()
    finished = subprocess.run(command, env=os.environ | OFFLINE, capture_output=True, text=True)
    if finished.returncode not in (0, 1):  # the doctor exits 1 on a diverging resume
        raise SystemExit(f"{command} exited {finished.returncode}: {finished.stderr.strip()[-500:]}")
    return time.perf_counter() - started


def measure(script: str, steps: int, repeats: int) -> dict:
    """Per-step seconds plain and traced, and the doctor's wall seconds against a straight run's."""
    plain, traced, straight, doctor, warm = [], [], [], [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as folder:
            plain.append(step_seconds(script, steps, False, Path(folder) / "p"))
            traced.append(step_seconds(script, steps, True, Path(folder) / "t"))
            command = [sys.executable, str(SCRIPTS / f"{script}.py"), "--steps", "8", "--out"]
            straight.append(wall_seconds([*command, f"{folder}/straight"]))
            flags = ["--steps", "8", "--stop-after", "4", "--out", f"{folder}/doctor", "--resume-args=--resume"]
            doctor_command = [sys.executable, "-m", "exactresume.cli", "doctor", *flags]
            doctor.append(wall_seconds([*doctor_command, "--", *command, f"{folder}/doctored"]))
            warm.append(wall_seconds([*doctor_command, "--warm", "--", *command, f"{folder}/warm"]))
    median = statistics.median
    return {
        "step_plain_s": median(plain),
        "step_traced_s": median(traced),
        "step_ratio": median(traced) / median(plain),
        "straight_s": median(straight),
        "doctor_s": median(doctor),
        "wall_ratio": median(doctor) / median(straight),
        "doctor_warm_s": median(warm),
        "warm_ratio": median(warm) / median(straight),
    }
