"""Training figures: exactresume's loop vs a minimal PyTorch loop, and FLOP/s vs a plain matmul.

Both loops train the same model class with the same optimizer on batches of the same shape; the
minimal loop's batches are drawn before timing, so everything exactresume does per step beyond
forward, backward, clipping and the optimizer (drawing windows, the lr schedule, the step record,
the log row) counts against it.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from exactresume.config import TrainConfig
from exactresume.core.data import TokenData
from exactresume.core.steplog import LOSS_HEADER, StepLog
from exactresume.training.loop import Run, build_run, train

from .measure import Summary, Trial, interleave, ratio, timed

MATMUL_SIZE = 2048  # the square fp32 matmul that stands for "this CPU's speed" (MACHINE-NOTES: ~205 GFLOP/s)
MATMUL_COUNT = 1  # matmuls per timed repetition


def step_flops(run: Run) -> float:
    """FLOPs of one training step: 6 * params * tokens, plus causal attention (6 * layers * T * width per token).

    Parameters are counted once (the tied embedding is the lm_head's matmul). Attention scores and
    their weighted sum cost 4 * T * width per token per layer forward with no mask; a causal mask
    halves it, and backward doubles the forward, hence 6 * T * width."""
    model = run.model.config
    tokens = run.config.batch * run.config.seq_len
    params = sum(p.numel() for p in run.model.parameters())
    width = model.num_attention_heads * model.head_dim
    return 6.0 * params * tokens + 6.0 * model.num_hidden_layers * run.config.seq_len * width * tokens


@dataclass
class MinimalLoop:
    """A hand-written loop: zero_grad, loss, backward, clip, step; no schedule, no logging."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    grad_clip: float

    def steps(self, count: int) -> None:
        self.model.train()
        for index in range(count):
            inputs, targets = self.batches[index % len(self.batches)]
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.model.loss(inputs, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.optimizer.step()


def minimal_loop(config: TrainConfig, data: TokenData, pool: int) -> MinimalLoop:
    """The same model and optimizer exactresume builds, with `pool` batches drawn up front."""
    twin = build_run(config, data)
    batches = [tuple(t.contiguous() for t in twin.batches.windows(twin.batches.draw_starts())) for _ in range(pool)]
    return MinimalLoop(twin.model, twin.optimizer, batches, config.grad_clip)


def exactresume_steps(run: Run, count: int, log: StepLog) -> None:
    """`count` steps of exactresume's loop, logging each step as `exactresume train` does."""
    # The CLI's per-step cost included: each step's loss row appended to the log.
    train(run, run.step.value + count, lambda record: log.append(record.step, f"{record.loss:.6f}"))


def matmul_trial(threads: int, size: int) -> Trial:
    """A trial timing MATMUL_COUNT square matmuls on `threads` threads (into a warm output)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    out = torch.mm(a, b)

    def trial() -> float:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return timed(lambda: [torch.mm(a, b, out=out) for _ in range(MATMUL_COUNT)])
        finally:
            torch.set_num_threads(previous)

    return trial


class CpuClock:
    """Wraps trials to also record this process's CPU seconds per call (robust to other jobs' load)."""

    def __init__(self):
        self.seconds: dict[str, list[float]] = {}

    def wrap(self, name: str, trial: Trial, divide: int = 1) -> Trial:
        def measured() -> float:
            started = time.process_time()
            wall = trial()
            self.seconds.setdefault(name, []).append((time.process_time() - started) / divide)
            return wall

        return measured


def bench_training(
    config: TrainConfig, data: TokenData, steps_per_rep: int, reps: int, matmul_size: int = MATMUL_SIZE
) -> tuple[dict, Run]:
    """Interleave both loops and the matmuls; returns the figures and the trained exactresume run."""
    with tempfile.TemporaryDirectory(prefix="exactresume-bench-") as scratch:
        log = StepLog(Path(scratch) / "log.csv", LOSS_HEADER, 0).open()
        run, loop, cpu = build_run(config, data), minimal_loop(config, data, steps_per_rep), CpuClock()
        all_threads = os.cpu_count() or 1
        trials = {
            "exactresume": cpu.wrap(
                "exactresume",
                lambda: timed(lambda: exactresume_steps(run, steps_per_rep, log)) / steps_per_rep,
                steps_per_rep,
            ),
            "minimal": cpu.wrap(
                "minimal", lambda: timed(lambda: loop.steps(steps_per_rep)) / steps_per_rep, steps_per_rep
            ),
            "matmul_1_thread": cpu.wrap("matmul_1_thread", matmul_trial(1, matmul_size)),
        }
        for threads in (torch.get_num_threads(), all_threads):  # the loop's own, the baseline; and all, for show
            trials.setdefault(matmul_name(threads), matmul_trial(threads, matmul_size))
        times = interleave(trials, reps)
        cpu_times = {name: values[-reps:] for name, values in cpu.seconds.items()}  # drop the warm-up round
        return training_figures(run, times, cpu_times, 2.0 * matmul_size**3 * MATMUL_COUNT), run


def matmul_name(threads: int) -> str:
    return "matmul_1_thread" if threads == 1 else f"matmul_{threads}_threads"


def training_figures(run: Run, times: dict, cpu_times: dict, matmul_flops: float) -> dict:
    """The loop's figures. Compute efficiency divides by the matmul on the loop's number of threads,
    timed in the same rounds: the all-thread matmul collapses when other jobs load the machine."""
    flops = step_flops(run)
    matmul_rates = {
        name: matmul_flops / Summary.of(values).median for name, values in times.items() if name.startswith("matmul")
    }
    baseline = matmul_name(torch.get_num_threads())
    step_rate = flops / Summary.of(times["exactresume"]).median
    efficiency = step_rate / matmul_rates[baseline]
    cpu_efficiency = (flops / Summary.of(cpu_times["exactresume"]).median) / (
        matmul_flops / Summary.of(cpu_times["matmul_1_thread"]).median
    )
    overhead = ratio(times["minimal"], times["exactresume"])  # steps/s ours over steps/s minimal
    return {
        "params": sum(p.numel() for p in run.model.parameters()),
        "threads": torch.get_num_threads(),
        "step_flops": flops,
        "train_overhead_ratio": overhead["ratio"],
        "train_overhead": overhead
        | {
            "goal": ">= 0.97",
            "met": overhead["ratio"] >= 0.97,
            "cpu_ratio": ratio(cpu_times["minimal"], cpu_times["exactresume"]),
            "what": "minimal loop's step time / exactresume's step time (= steps/s ours / minimal)",
        },
        "compute_efficiency": efficiency,
        "compute": {
            "step_flop_per_s": step_rate,
            "matmul_flop_per_s": matmul_rates,
            "baseline": baseline,
            "matmul_s": {name: Summary.of(v).to_dict() for name, v in times.items() if name.startswith("matmul")},
            "cpu_time_efficiency": cpu_efficiency,
            "what": "wall FLOP/s of a step / wall FLOP/s of a plain matmul on as many threads, same rounds; "
            "cpu_time_efficiency: FLOP per CPU-second of a step / of a 1-thread matmul",
            "goal": ">= 0.6 (default preset)",
            "met": efficiency >= 0.6,
        },
    }
