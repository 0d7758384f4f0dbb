"""`exactresume ablate`: resume with one part of the resume file left out or degraded, and measure
how far each resumed run lands from the run that never stopped.

Three setups, each one straight run that writes its resume file as it passes step K: the run as
configured (`base`), the same with dropout on (`dropout`: only then does the global RNG decide
anything), and the same through the epoch loader (`epoch`). Every variant restores that file with
`restore(..., skip=...)` after one small named degrade function, then trains the remaining steps
with the same `train()` — no second training loop. Against its setup's straight run it measures the
final weights (max abs and relative L2 difference), the loss at the first resumed step and at the
last step, the validation loss at the end, and, counted from the samples logs it writes, how many
sample trainings were extra (a sample seen twice) and how many missing (a sample never seen).

Everything runs in this process on one torch thread (bit-exact resume across processes is what the
tests check). Writes OUT/ablation.json (deterministic: the same command writes the same bytes),
OUT/ablation.md, and the resume files and samples logs under OUT/ablation/.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from exactresume.atomic import atomic_write_bytes, ensure_writable_folder, write_json
from exactresume.config import TrainConfig, check_stop_at
from exactresume.core.compare import weight_distance
from exactresume.core.data import TokenData, ensure_data, load_tokens
from exactresume.core.epochs import TokenSamples
from exactresume.core.steplog import read_samples
from exactresume.errors import UserError
from exactresume.report.tables import render_markdown
from exactresume.store.access import save_resume
from exactresume.store.resume import read_resume_file, restore
from exactresume.training.loop import Run, StepRecord, build_run, train

ABLATION_VERSION = 1
# Reduction order, and so the last bits of every number, depends on torch's thread count; one
# thread makes the table the same on every machine of a kind, and is not slowed by busy cores.
ABLATION_THREADS = 1
VAL_TOKENS = 4096  # the validation loss reads this head of val.npy: enough to rank runs, cheap on a CPU


# --- degrade functions: each takes a loaded resume state and returns it damaged in one way ---


def keep(state: dict) -> dict:
    return state


def _reset_adam_steps(state: dict) -> dict:
    """AdamW's per-parameter step counters back to 0, moments kept: bias correction restarts."""
    for per_param in state["optimizer"]["state"].values():
        per_param["step"] = torch.zeros_like(per_param["step"])
    return state


def _weights_rounded_to(dtype: torch.dtype) -> Callable[[dict], dict]:
    """The resume file's weights stored in `dtype` (what MiniMind's resume file does with fp16), as the
    fp32 model takes them back: rounded to `dtype`, then widened again, as loading them would."""

    def round_weights(state: dict) -> dict:
        state["model"] = {name: tensor.to(dtype).to(tensor.dtype) for name, tensor in state["model"].items()}
        return state

    round_weights.__name__ = f"weights_rounded_to_{str(dtype).removeprefix('torch.')}"
    return round_weights


def _lose_epoch_cursor(state: dict) -> dict:
    """The epoch loader restarts its current epoch from the first batch (the epoch itself is kept)."""
    state["gen_state"] = state["gen_state"] | {"cursor": 0}
    return state


@dataclass(frozen=True)
class Variant:
    """One row: which setup it resumes, the part it concerns, and how that part is lost."""

    setup: str
    name: str
    part: str  # "" for the reference row that restores everything
    skip: frozenset[str] = frozenset()
    degrade: Callable[[dict], dict] = keep


VARIANTS = (
    Variant("base", "exact", ""),
    Variant("base", "noopt", "optimizer", skip=frozenset({"optimizer"})),
    Variant("base", "adam_steps_reset", "optimizer", degrade=_reset_adam_steps),
    Variant("base", "noskip", "gen_state", skip=frozenset({"gen_state"})),
    Variant("base", "nostep", "step", skip=frozenset({"step"})),
    Variant("base", "fp16_weights", "model", degrade=_weights_rounded_to(torch.float16)),
    Variant("base", "bf16_weights", "model", degrade=_weights_rounded_to(torch.bfloat16)),
    Variant("dropout", "exact", ""),
    Variant("dropout", "norng", "rng", skip=frozenset({"rng"})),
    Variant("epoch", "exact", ""),
    Variant("epoch", "nocursor", "gen_state", degrade=_lose_epoch_cursor),
)


@dataclass(frozen=True)
class AblationConfig:
    train: TrainConfig = field(default_factory=TrainConfig)
    stop_at: int = 30
    data: Path = Path("data/kjv")
    out: Path = Path("runs/ablate")
    dropout: float = 0.1  # the dropout setup's dropout, when the configured run has none

    def __post_init__(self) -> None:
        check_stop_at(self.stop_at, self.train.steps)
        if self.train.shard != "none":  # its runs resume from one resume.pth; FSDP2 writes a DCP folder
            raise UserError("the ablation runs without --shard fsdp (exactresume train takes it)")
        if not 0.0 < self.dropout < 1.0:
            raise UserError(f"--ablation-dropout must be in (0, 1), got {self.dropout}")

    def setups(self) -> dict[str, TrainConfig]:
        return {
            "base": self.train,
            "dropout": self.train.with_changes(dropout=self.train.dropout or self.dropout),
            "epoch": self.train.with_changes(loader="epoch"),
        }


@dataclass
class Straight:
    """What a setup's uninterrupted run ended with."""

    weights: dict[str, torch.Tensor]
    losses: list[float]  # per step, 1-based step i at index i - 1
    val_loss: float


def _val_loss(run: Run, tokens: np.ndarray, rows_per_batch: int = 64) -> float:
    """Mean next-token loss over the first VAL_TOKENS (+ 1) tokens of val.npy, cut into consecutive
    windows of seq_len + 1 (eval mode, fp32)."""
    samples = TokenSamples(torch.from_numpy(tokens[: VAL_TOKENS + 1].astype(np.int64)), run.config.seq_len)
    if len(samples) == 0:
        raise UserError(f"val.npy holds {len(tokens)} tokens, too few for one window of --seq-len {run.config.seq_len}")
    rows = torch.stack([samples[i][1] for i in range(len(samples))]).to(run.device)
    run.model.eval()
    with torch.no_grad():
        total = sum(
            run.model.loss(part[:, :-1], part[:, 1:]).double() * len(part) for part in rows.split(rows_per_batch)
        )
    return (total / len(rows)).item()


def _samples_csv(records: list[StepRecord]) -> bytes:
    """The `step,starts` samples log `exactresume train --samples` writes."""
    rows = [f"{r.step},{' '.join(str(int(s)) for s in r.starts)}\n" for r in records]
    return ("step,starts\n" + "".join(rows)).encode()


def _final_weights(run: Run) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().cpu().clone() for name, tensor in run.model.state_dict().items()}


def _straight_run(config: TrainConfig, data: TokenData, stop_at: int, folder: Path) -> Straight:
    """Train the setup straight through, writing folder/resume.pth as the run passes `stop_at`."""
    run, records = build_run(config, data), []

    def on_step(record: StepRecord) -> None:
        records.append(record)
        if record.step == stop_at:
            save_resume(folder / "resume.pth", run.parts())

    train(run, config.steps, on_step)
    atomic_write_bytes(folder / "straight_samples.csv", _samples_csv(records))
    return Straight(_final_weights(run), [r.loss for r in records], _val_loss(run, data.val))


def _resume_variant(
    config: TrainConfig, data: TokenData, variant: Variant, folder: Path, remaining: int
) -> tuple[Run, list[StepRecord]]:
    """Restore the setup's resume file as the variant says, then train `remaining` steps."""
    state = variant.degrade(read_resume_file(folder / "resume.pth"))
    run, records = build_run(config, data), []
    restore(state, run.parts(), skip=variant.skip)
    # Counted from the restored step: without the `step` part the run starts again at 0.
    train(run, run.step.value + remaining, records.append)
    atomic_write_bytes(folder / f"{variant.name}_samples.csv", _samples_csv(records))
    return run, records


def _sample_counts(run_log: Path, straight_log: Path, stop_at: int) -> tuple[int, int]:
    """(extra, missing) sample trainings of the resumed run's history against the straight run's.

    The history is the straight run's steps up to `stop_at` (the part both share) plus the resumed
    steps. Extra: trainings of a sample beyond the straight run's count (a sample seen twice);
    missing: the straight run's trainings the resumed run never did (a sample never seen)."""
    straight, resumed = read_samples(straight_log), read_samples(run_log)
    reference = Counter(s for starts in straight.values() for s in starts)
    history = Counter(s for step, starts in straight.items() if step <= stop_at for s in starts)
    history.update(s for starts in resumed.values() for s in starts)
    return sum((history - reference).values()), sum((reference - history).values())


def measure(
    run: Run, records: list[StepRecord], straight: Straight, data: TokenData, logs: tuple[Path, Path], stop_at: int
) -> dict:
    seen_twice, never_seen = _sample_counts(*logs, stop_at)
    return weight_distance(_final_weights(run), straight.weights) | {
        "first_loss_diff": records[0].loss - straight.losses[stop_at],
        "final_loss_diff": records[-1].loss - straight.losses[-1],
        "val_loss_diff": _val_loss(run, data.val) - straight.val_loss,
        "samples_seen_twice": seen_twice,
        "samples_never_seen": never_seen,
    }


def _run_setup(
    name: str, config: TrainConfig, ablation: AblationConfig, data: TokenData, log
) -> tuple[dict, list[dict]]:
    """One setup's straight run and its variants: (the straight run's figures, one row per variant)."""
    folder = ablation.out / "ablation" / name
    ensure_writable_folder(folder)
    straight = _straight_run(config, data, ablation.stop_at, folder)
    rows = []
    for variant in (v for v in VARIANTS if v.setup == name):
        run, records = _resume_variant(config, data, variant, folder, config.steps - ablation.stop_at)
        logs = (folder / f"{variant.name}_samples.csv", folder / "straight_samples.csv")
        rows.append(
            {
                "setup": name,
                "name": variant.name,
                "part": variant.part,
                "skip": sorted(variant.skip),
                "degrade": variant.degrade.__name__,
            }
            | measure(run, records, straight, data, logs, ablation.stop_at)
        )
        log(f"ablate {name}/{variant.name}: max abs weight difference {rows[-1]['max_abs_diff']:.3e}")
    return {"final_loss": straight.losses[-1], "val_loss": straight.val_loss}, rows


@contextlib.contextmanager
def _torch_threads(count: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def run_ablation(config: AblationConfig, log=print) -> dict:
    """Every setup and variant; writes OUT/ablation.json and OUT/ablation.md and returns the json's dict."""
    ensure_writable_folder(config.out)
    ensure_data(config.data)
    data = load_tokens(config.data)
    started = time.perf_counter()
    setups = config.setups()
    result = {
        "version": ABLATION_VERSION,
        "steps": config.train.steps,
        "stop_at": config.stop_at,
        "torch_threads": ABLATION_THREADS,
        "setups": {name: c.to_dict() for name, c in setups.items()},
        "straight": {},
        "rows": [],
    }
    with _torch_threads(ABLATION_THREADS):
        for name, setup_config in setups.items():
            result["straight"][name], rows = _run_setup(name, setup_config, config, data, log)
            result["rows"] += rows
    write_json(config.out / "ablation.json", result)
    atomic_write_bytes(config.out / "ablation.md", (render_markdown(result) + "\n").encode())
    log(f"ablation.json, ablation.md ({time.perf_counter() - started:.1f} s)")
    return result


# --- rendering: the table of docs/resume-file.md and of the lab report, from ablation.json alone ---
