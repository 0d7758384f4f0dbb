"""What a run will need, from its shapes alone, and the refusal of a run that cannot fit.

    plan = plan_run(config, save_every=10, keep=3)   # arithmetic only: no tensor, no torch import
    print("\\n".join(plan.lines()))                    # exactresume train --dry-run
    check_fits(plan, available_memory())             # UserError: "needs about 48 GB, 21 GB available; ..."

The memory estimate of one process is the sum of what it holds at the peak of a step:

    process      the interpreter, torch and its libraries, exactresume and the data's maps, before a
                 model exists (PROCESS_BYTES, measured), and under autocast the half-precision kernels'
                 own (AUTOCAST_BYTES)
    weights      fp32 parameters (the tied lm_head counted once), plus a half-precision copy under autocast
    gradients    one per parameter, fp32
    adamw        exp_avg and exp_avg_sq, fp32
    buckets      DDP's gradient buckets (one more copy of the gradients), under --nproc without FSDP
    activations  what backward keeps per layer, for micro-batch x seq-len tokens x layers
    dropout      with --dropout: the masks and dropped copies backward keeps, and attention's scores,
                 which scaled_dot_product_attention then keeps for every layer
    attention    one layer's score matrix and its softmax, micro-batch x heads x seq-len^2
    head         the chunked cross-entropy's saved gradients and one chunk of logits
    staging      --async-save's copy of the state (weights and AdamW), kept between saves
    serialized   --async-save process: the helper's torch.save bytes of the last save, in memory
                 shared with this process (the helper's own interpreter and torch are not counted)
    whole        with --shard fsdp: what rank 0 gathers whole to write a single file, the weights
                 (final.pth) and, with --save-every, the weights and AdamW state of each checkpoint

What a step allocates (activations to head) is counted with the allocator's slack (STEP_SLACK): the
blocks freed by one operation are not all the right size for the next. Under --nproc N each of N
processes holds all of it for its 1/N of the batch; with --shard fsdp it holds 1/N of the weights,
gradients and AdamW state, plus the whole model it builds before sharding (so the initial weights are
one process's bits) and the whole weights and gradients of the root (the embedding) and of two
blocks, which FSDP2 gathers while one runs and the next is fetched. The estimate errs on the high
side: `python -m bench.plan_memory` measures the peak of runs on every preset, on 1 and 2 processes,
DDP and FSDP, fp32 and bf16, with and without dropout, and the estimate lies within 1.0x and 1.5x of
each (docs/plan_memory.json).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from exactresume.atomic import ensure_writable_folder
from exactresume.config import ModelConfig, TrainConfig
from exactresume.errors import UserError

FP32 = 4
# Measured with torch 2.13 on the CPU (bench/plan_memory.py): a process that imported exactresume's
# training stack and mapped its data holds about 340 MB before its model exists, and the first
# half-precision (bf16/fp16) kernels bring about 130 MB more of their own.
PROCESS_BYTES = 380 << 20
AUTOCAST_BYTES = 140 << 20
STEP_SLACK = 1.4
CHECKPOINT_OVERHEAD = 256 << 10  # RNG states, the batch generator, config, zip records
LOGIT_CHUNK_BYTES = 4 << 20  # model.LOGIT_CHUNK_BYTES (not imported: that module imports torch)
CHECKPOINT_FILE = re.compile(r"^step-\d{8,}\.pth$")  # numbered.CHECKPOINT_NAME (the store imports torch)


def parameter_count(model: ModelConfig) -> int:
    """The model's parameters, the tied embedding counted once (what `model.parameters()` yields)."""
    h, kv = model.hidden_size, model.num_key_value_heads * model.head_dim
    attention = 2 * h * h + 2 * h * kv + 2 * model.head_dim  # q, o; k, v; q_norm, k_norm
    block = attention + 3 * h * model.intermediate_size + 2 * h  # SwiGLU; two RMSNorms
    return model.vocab_size * h + model.num_hidden_layers * block + h  # embedding (= lm_head); final norm


@dataclass(frozen=True)
class RunPlan:
    """A run's size: its parameters, each process's memory by part, its files on disk."""

    config: TrainConfig
    processes: int
    parameters: int
    memory: dict[str, int]  # part -> bytes, one process
    checkpoint_bytes: int
    disk_bytes: int  # free space the run's writes need at their peak
    disk_what: str
    notes: list[str] = field(default_factory=list)

    @property
    def process_bytes(self) -> int:
        """One process's estimate."""
        return sum(self.memory.values())

    @property
    def memory_bytes(self) -> int:
        """All processes on this machine together."""
        return self.process_bytes * self.processes

    def lines(self) -> list[str]:
        c = self.config
        micro = c.batch // (self.processes * c.grad_accum)
        per = f" per process, x{self.processes}" if self.processes > 1 else ""
        parts = ", ".join(f"{name} {human(size)}" for name, size in self.memory.items())
        return [
            f"model: {c.preset}, {self.parameters:,} parameters",
            f"shape: batch {c.batch} (micro-batch {micro} x {c.grad_accum} accumulated{per}), seq-len {c.seq_len}",
            f"memory: about {human(self.memory_bytes)} ({parts}{per})",
            f"checkpoint: about {human(self.checkpoint_bytes)} each",
            f"disk: about {human(self.disk_bytes)} free needed ({self.disk_what})",
            *self.notes,
        ]


def plan_run(
    config: TrainConfig,
    processes: int = 1,
    save_every: int | None = None,
    keep: int | None = 3,
    async_save: str | None = None,
    stop_at: int | None = None,
    vocab_size: int | None = None,
) -> RunPlan:
    """The plan of a run of `config` on `processes` processes, checkpointing as the flags say.

    `vocab_size`: the tokenizer's (data_vocab_size), which the model takes over the preset's.
    """
    model = replace(config.model, vocab_size=vocab_size or config.model.vocab_size)
    params = parameter_count(model)
    checkpoint = 3 * params * FP32 + CHECKPOINT_OVERHEAD  # weights, exp_avg, exp_avg_sq
    shards = processes if config.fsdp else 1  # what each process holds 1/shards of
    held = -(-params // shards)  # this process's parameters, rounded up
    memory = {
        "process": PROCESS_BYTES + (AUTOCAST_BYTES if config.dtype != "fp32" else 0),
        "weights": held * FP32 + (params * 2 if config.dtype != "fp32" else 0),
        "gradients": held * FP32,
        "adamw": 2 * held * FP32,
        **({"buckets": params * FP32} if processes > 1 and shards == 1 else {}),
        **({"gathered": params * FP32 + 4 * _gathered_parameters(model) * FP32} if shards > 1 else {}),
        **({"whole": (3 if save_every else 1) * params * FP32} if shards > 1 else {}),
        **{name: int(size * STEP_SLACK) for name, size in _step_memory(config, model, processes).items()},
    }
    if async_save:
        memory["staging"] = checkpoint
    if async_save == "process":  # the helper's bytes of the last save, in shared memory
        memory["serialized"] = checkpoint
    disk, what = _disk_need(config, checkpoint, params, save_every, keep, stop_at)
    return RunPlan(config, processes, params, memory, checkpoint, disk, what)


def _gathered_parameters(model: ModelConfig) -> int:
    """The parameters FSDP2 holds whole at once: the root's (the embedding, tied to the head) and two blocks'."""
    blocks = model.num_hidden_layers
    per_block = (parameter_count(model) - model.vocab_size * model.hidden_size - model.hidden_size) // blocks
    return model.vocab_size * model.hidden_size + min(2, blocks) * per_block


def _step_memory(config: TrainConfig, model: ModelConfig, processes: int) -> dict[str, int]:
    """The activations, attention working set and loss head of one micro-batch's forward and backward."""
    h, kv, inner = model.hidden_size, model.num_key_value_heads * model.head_dim, model.intermediate_size
    micro = max(1, config.batch // (processes * config.grad_accum))
    tokens = micro * config.seq_len
    width, layers = (FP32 if config.dtype == "fp32" else 2), model.num_hidden_layers
    per_token = (8 * h + 4 * kv + 4 * inner) * width
    scores = micro * model.num_attention_heads * config.seq_len * config.seq_len
    # A dropped tensor keeps its copy and a byte of mask (5 bytes a value); attention's scores, their
    # softmax, its mask and its dropped copy stay for every layer (11 bytes a score).
    dropout = tokens * h * (1 + layers) * 5 + layers * scores * 11 if config.dropout else 0
    return {
        "activations": tokens * per_token * layers,
        **({"dropout": dropout} if dropout else {}),
        "attention": 2 * scores * width,
        "head": 2 * tokens * h * FP32 + model.vocab_size * h * FP32 + LOGIT_CHUNK_BYTES,
    }


def _disk_need(
    config: TrainConfig, checkpoint: int, params: int, save_every: int | None, keep: int | None, stop_at: int | None
) -> tuple[int, str]:
    """Free bytes the run's files need at their peak, and what they are."""
    final = checkpoint if stop_at is not None else params * FP32
    final_what = ("resume.dcp" if config.fsdp else "resume.pth") if stop_at is not None else "final.pth"
    if save_every is None:
        return final, f"{final_what}"
    if keep is None:
        saves = len(
            {s for s in range(save_every, (stop_at or config.steps) + 1, save_every)} | {stop_at or config.steps}
        )
        return saves * checkpoint + final, f"all {saves} checkpoints kept, and {final_what}"
    return (keep + 1) * checkpoint, f"{keep} checkpoints kept by --keep and 1 being written"


def data_vocab_size(folder: Path) -> int | None:
    """The vocabulary of a prepared data folder, from its manifest (None when it cannot be read)."""
    try:
        size = json.loads((Path(folder) / "manifest.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return size if isinstance(size, int) and size > 0 else None


def _check_seq_len(config: TrainConfig) -> None:
    """Refuse a sequence longer than the model's position table (RoPE's max_position_embeddings)."""
    longest = config.model.max_position_embeddings
    if config.seq_len > longest:
        raise UserError(
            f"--seq-len {config.seq_len} is beyond the model's max_position_embeddings ({longest}) "
            f"of --preset {config.preset}; use at most {longest}"
        )


def _memory_budget(plan: RunPlan) -> tuple[int, int | None, str]:
    """(bytes needed, bytes available or None when unknown, where): host memory, or one GPU's under cuda."""
    if plan.config.device != "cuda":
        return plan.memory_bytes, available_memory(), "memory"
    import torch  # only for a cuda run, which imports it anyway

    on_gpu = sum(size for name, size in plan.memory.items() if name != "staging")  # one process per GPU
    free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
    return on_gpu, free, "GPU memory"


def _check_memory(plan: RunPlan) -> None:
    """Refuse a plan that needs more memory than is available (nothing is refused where that is unknown)."""
    need, available, where = _memory_budget(plan)
    if available is None or need <= available:
        return
    more = "a larger --grad-accum" if plan.config.grad_accum > 1 else "--grad-accum"
    raise UserError(
        f"this run needs about {human(need)} of {where}, {human(available)} available; "
        f"lower --batch or --seq-len, or use {more} (--force to start anyway)"
    )


def _preflight(plan: RunPlan, folder: Path, force: bool = False, retained: bool = True, report=None) -> None:
    """Refuse, before any tensor exists, a run that cannot fit its memory or its disk (--force: only note it).

    A sequence longer than the model's position table is refused even with `force`. `retained`: the
    checkpoints already in `folder` are deleted by retention as new ones come (--keep K, not 0).
    `report`, when given, receives what is available and the verdict (--dry-run).
    """
    _check_seq_len(plan.config)
    existing = existing_checkpoints(folder) if retained else 0
    problems = []
    for check in (lambda: _check_memory(plan), lambda: check_disk(plan, folder, existing)):
        try:
            check()
        except UserError as error:
            if not force:
                raise
            problems.append(str(error).removesuffix(" (--force to start anyway)").split("; ")[0])
    if report is not None:
        need, available, where = _memory_budget(plan)
        free = free_space(folder)
        report(f"available: {where} {human(available) if available else 'unknown'}, disk {human(free or 0)} free")
    for problem in problems:
        print(f"exactresume train: --force: starting although {problem}", flush=True)
    if report is not None:
        report("verdict: fits" if not problems else "verdict: does not fit (started anyway with --force)")


def check_disk(plan: RunPlan, folder: Path, existing: int = 0) -> None:
    """Refuse a plan whose files do not fit the free space of the file system holding `folder`.

    `existing` is the bytes of checkpoints already in the folder that retention will delete.
    """
    free = free_space(folder)
    need = max(plan.checkpoint_bytes, plan.disk_bytes - existing) if existing else plan.disk_bytes
    if free is None or need <= free:
        return
    raise UserError(
        f"{folder} needs about {human(need)} free for {plan.disk_what}, {human(free)} free; "
        "free space, lower --keep (--force to start anyway)"
    )


def free_space(folder: Path) -> int | None:
    """Bytes an unprivileged write may still use on the file system of `folder` (or its nearest parent)."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        stats = os.statvfs(folder)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def existing_checkpoints(folder: Path) -> int:
    """Bytes of the checkpoint files (step-N.pth) already in `folder`."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    return sum(e.stat().st_size for e in entries if CHECKPOINT_FILE.match(e.name) and e.is_file())


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable from /proc/meminfo (Linux), in bytes; None where there is no such file."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def human(size: float) -> str:
    """Bytes in decimal units, two or three significant digits: '48 GB', '3.2 MB'."""
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000:
            return f"{size:.0f} {unit}" if unit == "B" or size >= 10 else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.0f} TB" if size >= 10 else f"{size:.1f} TB"


def plan_job(job) -> RunPlan:
    """The plan of a train job (printed with its `dry_run`); a run that cannot fit is refused before
    torch is imported. A run that will write makes its OUT first, so that a folder that cannot be made
    is named as that, not as a full disk."""
    plan = plan_run(
        job.config,
        job.processes,
        job.save_every,
        job.keep,
        job.async_save,
        job.stop_at,
        vocab_size=data_vocab_size(job.data),
    )
    report = print if job.dry_run else None
    if report is not None:
        report("\n".join(plan.lines()))
    else:
        ensure_writable_folder(job.out)
    folder = job.out / "checkpoints" if job.save_every else job.out
    _preflight(plan, folder, force=job.force, retained=job.keep is not None, report=report)
    return plan
