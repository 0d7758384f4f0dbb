"""`python -m bench` (what `make bench` runs): every figure, written to bench.json and printed as a table.

python -m bench                                   # default, minimind-26m, minimind-64m; about 20 minutes
python -m bench --presets default --reps 5        # one preset
python -m bench --toy --out /tmp/b                # the harness on a toy size, in seconds (figures meaningless)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from exactresume.atomic import atomic_write_bytes
from exactresume.config import PRESETS, TrainConfig
from exactresume.core.data import ensure_data, load_tokens

from .asynchronous import bench_async_block, bench_async_throughput
from .files import bench_load, bench_save
from .growth import growth
from .labwall import DEFAULT_STOP_AT, bench_lab
from .measure import load_average
from .memory import memory_figures
from .prepare import MINIMIND_TOKENIZER, bench_prepare
from .recovery import recovery_figures
from .table import render
from .training import MATMUL_SIZE, bench_training

# Training steps per timed repetition: enough to last a few hundred milliseconds.
STEPS_PER_REP = {"default": 3, "minimind-26m": 1, "minimind-64m": 1}
THROUGHPUT_PRESETS = ("default",)  # a 30-step round of the larger presets would take minutes


def bench_preset(name: str, args: argparse.Namespace, data, folder: Path, log) -> dict:
    config = TrainConfig(steps=10**6, batch=args.batch, seq_len=args.seq_len, preset=name)
    steps = 2 if args.toy else STEPS_PER_REP.get(name, 1)
    started = time.perf_counter()
    figures, run = bench_training(config, data, steps, args.reps, matmul_size=256 if args.toy else MATMUL_SIZE)
    log(f"{name}: training {time.perf_counter() - started:.0f} s")
    figures |= bench_save(run, folder, args.reps) | bench_load(folder, args.reps, name)
    (folder / "resume.pth").unlink()
    figures |= bench_async_block(run, folder / "async", args.reps)
    if name in THROUGHPUT_PRESETS:
        figures |= bench_async_throughput(
            run, folder / "async", args.reps, steps=4 if args.toy else 30, every=2 if args.toy else 1
        )
    else:
        figures |= {
            "async_throughput_ratio": None,
            "async_throughput": {"status": f"measured on {', '.join(THROUGHPUT_PRESETS)} only (bench time)"},
        }
    del run
    log(f"{name}: + save/load {time.perf_counter() - started:.0f} s")
    figures["memory"] = memory_figures(config, args.data, folder)
    log(f"{name}: + memory {time.perf_counter() - started:.0f} s")
    return figures


def data_figures(args: argparse.Namespace, scratch: Path, log) -> dict:
    """bench/prepare.py on a generated corpus and bench/recovery.py on the 26M preset, unless skipped."""
    figures = {}
    if args.prepare_mb and MINIMIND_TOKENIZER.is_file():
        figures["prepare"] = bench_prepare(args.prepare_mb, scratch / "prepare", MINIMIND_TOKENIZER)
        log(f"prepare: {figures['prepare']['prepare_s']:.0f} s")
    else:
        figures["prepare"] = {"status": "not measured (--prepare-mb 0, or no MiniMind tokenizer)"}
    if args.recovery_reps:
        figures["recovery"] = recovery_figures("minimind-26m", args.data, scratch / "recovery", args.recovery_reps)
    else:
        figures["recovery"] = {"status": "not measured (--recovery-reps 0)"}
    return figures


def notes(bench: dict) -> list[str]:
    """Sentences under the table, each made from the figures."""
    machine = bench["machine"]
    lines = [
        f"Measured on {machine['cpus']} CPUs shared with other jobs (1-minute load average "
        f"{machine['load_average_before']:.1f} before, {machine['load_average_after']:.1f} after); "
        f"medians of {bench['settings']['reps']} interleaved rounds after a warm-up round, "
        "(min–max) of the round-by-round ratios; ✗ marks a missed goal."
    ]
    for name, preset in bench["presets"].items():
        compute = preset.get("compute")
        if compute:
            same = compute["step_flop_per_s"] / compute["matmul_flop_per_s"]["matmul_1_thread"]
            cpu = preset["train_overhead"]["cpu_ratio"]["ratio"]
            lines.append(
                f"{name}: training on {preset['threads']} thread(s); compute efficiency {same:.2f} against a "
                f"1-thread matmul in wall time, {compute['cpu_time_efficiency']:.2f} in CPU time; training "
                f"overhead in CPU time {cpu:.3f}."
            )
    lab = bench.get("lab_wall", {})
    if "candidate_s" in lab:
        runs = ", ".join(
            f"{name} {seconds:.1f}"
            for name, seconds in lab["last_lab_timings_s"].items()
            if name not in ("prepare", "total")
        )
        lines.append(
            f"lab (default config, {lab['training_steps']} training steps): "
            f"median {lab['candidate_s']['median']:.1f} s "
            f"wall against {lab['baseline_s']['median']:.1f} s of step compute over {lab['candidate_s']['n']} rounds; "
            f"its last run's training processes took (s): {runs}."
        )
    lines += [kind["verdict"] for kind in bench.get("growth", {}).values()]
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="exactresume's benchmarks (ratios against same-run baselines).")
    parser.add_argument("--data", type=Path, default=Path("data/kjv"), help="prepared data (made if missing)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench"), help="folder for bench.json")
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated preset names")
    parser.add_argument("--reps", type=int, default=5, help="measured repetitions per figure (after one warm-up)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lab-reps", type=int, default=3, help="repetitions of the whole lab (0: skip)")
    parser.add_argument(
        "--budget-min",
        type=float,
        default=14,
        help="start no further lab round that would end later (at least one runs)",
    )
    parser.add_argument("--prepare-mb", type=float, default=2048, help="generated corpus for prepare (0: skip)")
    parser.add_argument("--recovery-reps", type=int, default=3, help="rounds of the kill -9 restart (0: skip)")
    parser.add_argument(
        "--toy", action="store_true", help="default preset at batch 2 x 16, 2 reps, no lab: checks the harness"
    )
    args = parser.parse_args(argv)
    if args.toy:
        args.presets, args.reps, args.batch, args.seq_len, args.lab_reps = "default", 2, 2, 16, 0
        args.prepare_mb, args.recovery_reps = 0, 0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = lambda message: print(message, file=sys.stderr, flush=True)
    started, load_before = time.perf_counter(), load_average()
    ensure_data(args.data)
    data = load_tokens(args.data)
    args.out.mkdir(parents=True, exist_ok=True)
    bench: dict = {"presets": {}}
    with tempfile.TemporaryDirectory(dir=args.out) as scratch:
        for name in args.presets.split(","):
            bench["presets"][name] = bench_preset(name, args, data, Path(scratch), log)
        lab_config = TrainConfig(batch=args.batch, seq_len=args.seq_len)
        if args.lab_reps:
            deadline = started + args.budget_min * 60
            bench |= bench_lab(lab_config, DEFAULT_STOP_AT, data, Path(scratch) / "lab", args.lab_reps, deadline)
            log(f"lab: {time.perf_counter() - started:.0f} s")
        else:
            bench |= {"lab_wall_ratio": None, "lab_wall": {"status": "not measured (--lab-reps 0)"}}
        bench |= data_figures(args, Path(scratch), log)
    bench["growth"] = growth(bench["presets"])
    bench["machine"] = {
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "shared": "other people's jobs may run at the same time; ratios are within-run",
    }
    bench["settings"] = {
        "reps": args.reps,
        "warmup_rounds": 1,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "toy": args.toy,
        "lab_reps": args.lab_reps,
        "wall_s": time.perf_counter() - started,
    }
    bench["notes"] = notes(bench)
    atomic_write_bytes(args.out / "bench.json", (json.dumps(bench, indent=2) + "\n").encode())
    print(render(bench))
    log(f"wrote {args.out / 'bench.json'} ({time.perf_counter() - started:.0f} s)")
    return 0
