"""Run configuration: the model's shape (MiniMind's field names) and the training hyperparameters.

Configuration flows one way: CLI flags -> these dataclasses -> functions. Both are frozen and
validated on construction (a refusal names fields, `FieldError`; the command line names their
flags), and both travel inside every resume file so a resume can check it is continuing the same run.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

from exactresume.errors import FieldError, UserError


def _minimind_intermediate_size(hidden_size: int) -> int:
    # MiniMind sizes the SwiGLU hidden layer as hidden * pi rounded up to a multiple of 64.
    return math.ceil(hidden_size * math.pi / 64) * 64


@dataclass(frozen=True)
class ModelConfig:
    """A MiniMind-compatible decoder's shape; field names are MiniMind's own."""

    hidden_size: int = 128  # width of the residual stream
    num_hidden_layers: int = 4  # decoder blocks
    num_attention_heads: int = 4  # query heads
    num_key_value_heads: int = 2  # shared key/value heads (grouped-query attention)
    vocab_size: int = 6400  # MiniMind's tokenizer size
    intermediate_size: int = 0  # SwiGLU width; 0 = MiniMind's rule, ceil(hidden * pi / 64) * 64
    rope_theta: float = 1e6  # RoPE base
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768  # RoPE table length
    dropout: float = 0.0  # attention, residual and embedding dropout

    def __post_init__(self) -> None:
        if self.intermediate_size == 0:
            object.__setattr__(self, "intermediate_size", _minimind_intermediate_size(self.hidden_size))
        if self.hidden_size % self.num_attention_heads:
            raise UserError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise UserError("head_dim must be even for RoPE")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


# Named model sizes. "default" trains 60 steps of 8 x 128 tokens in seconds on two CPU cores; "tiny"
# keeps the vocabulary (the tokenizer's) and shrinks the rest, for a resume's mechanics at a fraction
# of the cost (tries, tests); the others are MiniMind's published sizes, for users with a GPU: the 26M
# "small" model (whose MLP width followed the older 8/3 rule) and the current 64M default.
PRESETS: dict[str, ModelConfig] = {
    "default": ModelConfig(),
    "tiny": ModelConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1),
    "minimind-26m": ModelConfig(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1408
    ),
    "minimind-64m": ModelConfig(hidden_size=768, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4),
}


def preset(name: str) -> ModelConfig:
    """The model config for a preset name, or a UserError listing the names."""
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


DTYPES = ("fp32", "bf16", "fp16")
LOADERS = ("random", "epoch")
DEVICES = ("cpu", "cuda")
SHARDINGS = ("none", "fsdp")


# The groups of a command's --help. TrainConfig's fields name theirs in their metadata, so the
# flags made from them (commands/config_flags.py) and their --help cannot drift from the config.
RUN_GROUP = "the run"
FEATURES_GROUP = "training features"


def _flag_field(default, help: str, group: str = RUN_GROUP, choices: tuple | None = None):
    """A TrainConfig field and its command-line flag: --NAME (in kebab case), its help, group and choices."""
    return field(default=default, metadata={"help": help, "group": group, "choices": choices})


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides a training run's result (the lab's defaults); one flag per field."""

    seed: int = _flag_field(7, "seed of the model init, the batch generator and the global RNGs")
    steps: int = _flag_field(60, "total optimizer steps; the lr schedule is computed against this")
    batch: int = _flag_field(8, "sequences per optimizer step (all micro-batches together)")
    seq_len: int = _flag_field(128, "tokens per sequence")
    lr: float = _flag_field(3e-3, "peak learning rate of MiniMind's cosine schedule")
    weight_decay: float = _flag_field(0.01, "AdamW's decoupled weight decay (torch's default)")
    grad_clip: float = _flag_field(1.0, "max global gradient norm")
    preset: str = _flag_field("default", "model size", choices=tuple(PRESETS))
    grad_accum: int = _flag_field(1, "micro-batches per optimizer step (--batch is split among them)", FEATURES_GROUP)
    # The N-independent mode: its micro-batches' gradients are added along one fixed tree over their
    # index, so the result does not depend on the process count (parallel/exact.py).
    micro_batch: int = _flag_field(
        0,
        "N-independent mode: sequences per micro-batch, gradients added along one fixed tree, so the result is "
        "the same on any allowed --nproc (0: off, DDP's average)",
        FEATURES_GROUP,
    )
    # FSDP2 (parallel/fsdp.py): each rank holds 1/N of the weights, gradients and AdamW state.
    shard: str = _flag_field(
        "none",
        "fsdp: each process holds 1/N of the weights, gradients and optimizer state (FSDP2; resume state in DCP)",
        FEATURES_GROUP,
        SHARDINGS,
    )
    # The model's dropout masks come from the torch RNG, a resume part.
    dropout: float = _flag_field(0.0, "dropout probability of the model", FEATURES_GROUP)
    dtype: str = _flag_field(
        "fp32",
        "compute precision: fp32, or bf16/fp16 autocast (weights stay fp32; fp16 adds a loss scaler)",
        FEATURES_GROUP,
        DTYPES,
    )
    loader: str = _flag_field(
        "random", "random windows, or shuffled epochs through a DataLoader", FEATURES_GROUP, LOADERS
    )
    # Workers never change the result: the order is drawn in the main process.
    workers: int = _flag_field(0, "DataLoader worker processes (--loader epoch)", FEATURES_GROUP)
    warmup: int = _flag_field(0, "linear lr warmup steps before the cosine schedule", FEATURES_GROUP)
    device: str = _flag_field("cpu", "cpu, or cuda with deterministic kernels", FEATURES_GROUP, DEVICES)
    # The result depends on the thread count (parallel sums split by thread), so it is part of the
    # run; one thread is also the fastest for these small models on a shared machine.
    threads: int = _flag_field(1, "CPU threads per operation (part of the result)")

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "seq_len", "grad_accum", "threads"):
            if getattr(self, name) < 1:
                raise FieldError(f"{name} must be at least 1, got {getattr(self, name)}", name)
        if not self.lr > 0:
            raise FieldError(f"lr must be positive, got {self.lr}", "lr")
        if not self.weight_decay >= 0:
            raise FieldError(f"weight_decay must be at least 0, got {self.weight_decay}", "weight_decay")
        if not self.grad_clip > 0:
            raise FieldError(f"grad_clip must be positive, got {self.grad_clip}", "grad_clip")
        preset(self.preset)
        self._check_features()

    def _check_features(self) -> None:
        for name, allowed in (("dtype", DTYPES), ("loader", LOADERS), ("device", DEVICES), ("shard", SHARDINGS)):
            if getattr(self, name) not in allowed:
                raise FieldError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}", name)
        if self.batch % self.grad_accum:
            raise FieldError(
                f"batch {self.batch} (sequences per optimizer step) is not a multiple of grad_accum {self.grad_accum}",
                "batch",
                "grad_accum",
            )
        if not 0.0 <= self.dropout < 1.0:
            raise FieldError(f"dropout must be in [0, 1), got {self.dropout}", "dropout")
        self._check_micro_batch()
        if self.workers < 0:
            raise FieldError(f"workers must be at least 0, got {self.workers}", "workers")
        if self.workers and self.loader != "epoch":
            raise FieldError(
                f"workers {self.workers} needs loader epoch (random batches take no worker processes)",
                "workers",
                "loader",
            )
        if not 0 <= self.warmup < self.steps:
            raise FieldError(
                f"warmup {self.warmup} must be between 0 and steps - 1 ({self.steps - 1})", "warmup", "steps"
            )

    def _check_micro_batch(self) -> None:
        if self.micro_batch < 0 or (self.micro_batch and self.batch % self.micro_batch):
            raise FieldError(
                f"micro_batch {self.micro_batch} must be 0 (off) or divide batch {self.batch}", "micro_batch", "batch"
            )
        if self.micro_batch and self.grad_accum != 1:
            raise FieldError(
                "micro_batch sets the micro-batches of a step itself: leave grad_accum at 1",
                "micro_batch",
                "grad_accum",
            )
        if self.micro_batch and self.fsdp:
            # FSDP2 reduce-scatters every micro-batch's gradient over the ranks as it comes, in an order N sets.
            raise FieldError(
                "micro_batch (the N-independent mode) does not combine with shard fsdp", "micro_batch", "shard"
            )

    @property
    def model(self) -> ModelConfig:
        return replace(preset(self.preset), dropout=self.dropout)

    @property
    def fsdp(self) -> bool:
        """Each process holds 1/N of the weights, gradients and optimizer state (`--shard fsdp`)."""
        return self.shard == "fsdp"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    def with_changes(self, **changes) -> TrainConfig:
        return replace(self, **changes)


def check_stop_at(stop_at: int, steps: int) -> None:
    """Refuse a stop that leaves nothing before or after it: 1 <= stop_at < steps."""
    if not 1 <= stop_at < steps:
        raise FieldError(f"stop_at {stop_at} must be between 1 and steps - 1 ({steps - 1})", "stop_at", "steps")


def check_keep(keep: int | None) -> int | None:
    """How many checkpoints a store keeps, as given (`keep=` or --keep): None or 0 keeps every one."""
    if keep is None or keep == 0:
        return None
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise FieldError(f"keep must be a number of checkpoints (0: all of them), got {keep!r}", "keep")
    return keep


def check_wait_lock(seconds: float) -> None:
    """How long a writer waits for another to finish with its folder (--wait-lock): 0 refuses at once."""
    if seconds < 0:
        raise FieldError(f"wait_lock must be at least 0 seconds, got {seconds:g}", "wait_lock")
