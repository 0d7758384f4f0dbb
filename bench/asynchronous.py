"""Background-save figures (`--async-save`): how long the loop is blocked, and what saving costs it.

Both are measured with the copy `exactresume train --async-save` uses, copy="during-next-step"
(the state copied during the next step's forward and backward, the optimizer step waiting for it and
checking that nothing changed before it); the default copy a library caller gets, "before-return"
(the copy made before `save` returns), is timed beside it in the same rounds.

Blocked: the time the loop waits for a background save (the store's `blocked_seconds`: in
`save`, which takes the state dicts and starts the writer, and in the next optimizer step's wait for
the writer's copy and its check) against a synchronous `CheckpointStore.save` of the same state
(state dicts, sealed write, fsync, rename, folder fsync, read back and verify, retention). The
writer's remaining work is waited for outside the timing.

Throughput: `steps` training steps with a background save every `every` steps against the same
steps without saving. The candidate's time includes waiting for its last save to finish, so one
write in `steps / every` is never overlapped with training: the figure is a lower bound. With
`steady`, the figure is a long run's: the timed steps overlap as many saves' work as they start.

    python -m bench.asynchronous --reps 5 --steps 30     # these figures alone, default preset, as `make bench`
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from exactresume.config import TrainConfig
from exactresume.core.data import ensure_data, load_tokens
from exactresume.core.steplog import LOSS_HEADER, StepLog
from exactresume.store.background import BEFORE_RETURN, DURING_NEXT_STEP
from exactresume.store.numbered import CheckpointStore
from exactresume.training.loop import Run, build_run

from .measure import interleave, ratio, timed
from .training import exactresume_steps

BLOCK_GOAL, THROUGHPUT_GOAL = 0.1, 0.95


def bench_async_block(run: Run, folder: Path, reps: int) -> dict:
    shutil.rmtree(folder, ignore_errors=True)  # an earlier bench's checkpoints: a store refuses to save beside them
    folder.mkdir(parents=True)
    synchronous = CheckpointStore(folder / "sync", keep=1)
    log = StepLog(folder / "block_log.csv", LOSS_HEADER, 0).open()

    def blocked(copy: str):
        background = CheckpointStore(folder / copy, keep=1, background=True, copy=copy)

        def trial() -> float:
            before = background.blocked_seconds
            background.save(run.step.value, run.parts())
            exactresume_steps(run, 1, log)  # its optimizer step waits for the copy, if the copy is still running
            seconds = background.blocked_seconds - before
            background.wait()
            return seconds

        return trial

    trials = {"sync": lambda: timed(lambda: synchronous.save(run.step.value, run.parts()))}
    times = interleave(trials | {copy: blocked(copy) for copy in (DURING_NEXT_STEP, BEFORE_RETURN)}, reps)
    log.close()
    figure, before_return = ratio(times[DURING_NEXT_STEP], times["sync"]), ratio(times[BEFORE_RETURN], times["sync"])
    return {
        "async_block_ratio": figure["ratio"],
        "async_block": figure
        | {
            "goal": f"<= {BLOCK_GOAL}",
            "met": figure["ratio"] <= BLOCK_GOAL,
            "copy": DURING_NEXT_STEP,
            "what": "time the loop waits for a background save (in save and in the next "
            "optimizer step) / CheckpointStore.save (the synchronous sequence)",
        },
        "async_block_before_return": before_return
        | {
            "copy": BEFORE_RETURN,
            "what": "the same with a background store's default copy (made before save returns)",
        },
    }


def bench_async_throughput(
    run: Run,
    folder: Path,
    reps: int,
    steps: int = 30,
    every: int = 1,
    checkpoints: str | None = None,
    steady: bool = False,
    **store_options: Any,
) -> dict:
    """steps/s with a background save every `every` steps (into `checkpoints`, default a folder, a store
    with `store_options`) over steps/s
    without; at every 1 a save asked for while the one before is still written is skipped (as
    `train --save-every 1 --async-save` does).

    `steady`: the loop's throughput in a long run, where every save's work overlaps the steps after
    it. A save is started before the clock and the last one is waited for after it, so the timed
    `steps` hold exactly `steps / every` saves' work, as every stretch of that length of a long run does.
    Without it, the run ends waiting for its last save (the lower bound above)."""
    where = checkpoints or folder / "throughput"
    saver = CheckpointStore(where, keep=1, background=True, copy=DURING_NEXT_STEP, **store_options)
    log = StepLog(folder / "log.csv", LOSS_HEADER, 0).open()

    def train_and_save() -> None:
        for _ in range(steps // every):
            exactresume_steps(run, every, log)
            saver.save(run.step.value, run.parts(), coalesce=every == 1)
        if not steady:
            saver.wait()

    def saving() -> float:
        if steady:
            saver.save(run.step.value, run.parts())
        seconds = timed(train_and_save)
        saver.wait()
        return seconds

    times = interleave({"saving": saving, "plain": lambda: timed(lambda: exactresume_steps(run, steps, log))}, reps)
    log.close()
    saver.close()
    figure = ratio(times["plain"], times["saving"])  # steps/s with saves over steps/s without
    ending = "its last save waited for"
    if steady:
        ending = "a long run's stretch: each save's work overlaps the steps after it"
    return {
        "async_throughput_ratio": figure["ratio"],
        "async_throughput": figure
        | {
            "goal": f">= {THROUGHPUT_GOAL}",
            "met": figure["ratio"] >= THROUGHPUT_GOAL,
            "steps_per_round": steps,
            "save_every": every,
            "steady": steady,
            "copy": DURING_NEXT_STEP,
            "coalesced": saver.coalesced,
            "saves_asked": (reps + 1) * (steps // every + steady),
            "what": f"steps/s with --async-save --save-every {every} ({ending}) / steps/s without saving",
        },
    }


def main(argv: list[str] | None = None) -> int:
    """These figures alone, on one preset, as `python -m bench` measures them; printed as JSON."""
    parser = argparse.ArgumentParser(description="--async-save's figures (ratios against same-run baselines).")
    parser.add_argument("--data", type=Path, default=Path("data/kjv"), help="prepared data (made if missing)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-async"), help="folder for async.json")
    parser.add_argument("--preset", default="default")
    parser.add_argument("--reps", type=int, default=5, help="measured rounds per figure (after one warm-up)")
    parser.add_argument("--steps", type=int, default=30, help="training steps per throughput round")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args(argv)
    ensure_data(args.data)
    config = TrainConfig(steps=10**6, batch=args.batch, seq_len=args.seq_len, preset=args.preset)
    run = build_run(config, load_tokens(args.data))
    args.out.mkdir(parents=True, exist_ok=True)
    figures = bench_async_block(run, args.out / "scratch", args.reps)
    figures |= bench_async_throughput(run, args.out / "scratch", args.reps, steps=args.steps, every=1)
    figures["settings"] = vars(args) | {"data": str(args.data), "out": str(args.out)}
    (args.out / "async.json").write_text(json.dumps(figures, indent=2) + "\n")
    json.dump(figures, sys.stdout, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
