"""What each command says when it ends: what it found, what it wrote, and what to type next.

Every summary is built from the files the command wrote (their paths, sizes and json), never from
a second computation, as a dict that `--json` prints as is; `render_*` lays the same dict out as
aligned plain text. Imports only the standard library at the top: a summary of a lab that ran
must not pay for torch again.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from exactresume.store.locations import S3Location

FIGURE_NAMES = ("sizes", "loss_curves", "loss_diff", "divergence")  # report.figures.FIGURES, without matplotlib


# --- layout -------------------------------------------------------------------------------------


def aligned(rows: list[tuple[str, str]], indent: str = "") -> list[str]:
    """`label  value` lines with the values in one column."""
    width = max((len(label) for label, _ in rows), default=0)
    return [f"{indent}{label.ljust(width)}  {value}".rstrip() for label, value in rows]


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """Columns padded to their widest cell; the first one left-aligned, the numbers right-aligned."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(row: tuple[str, ...]) -> str:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        return "  ".join(cells).rstrip()

    return [line(header), *map(line, rows)]


def number(value: float | None, signed: bool = False) -> str:
    """0 as `0` (exactly zero is the point of a bit-exact resume), anything else in 4 significant digits."""
    if value is None:
        return "—"
    if value == 0:
        return "0"
    return f"{value:+.3e}" if signed else f"{value:.3e}"


def _size_of(path: Path) -> int:
    """Bytes of a file, or of every file in a folder (a sharded checkpoint)."""
    if path.is_dir():
        return sum(entry.stat().st_size for entry in path.rglob("*") if entry.is_file())
    return path.stat().st_size


def written(path: Path | S3Location) -> dict | None:
    """{"path", "bytes"} of an output that exists (a file, a folder, or its objects on a store), else None."""
    if isinstance(path, S3Location):
        from exactresume.store.s3.client import ObjectStore

        objects = ObjectStore(path.config)
        size = objects.size(path)
        size = sum(objects.list(path).values()) if size is None else size
        return {"path": str(path), "bytes": size} if size else None
    return {"path": str(path), "bytes": _size_of(path)} if path.exists() else None


def _file_text(entry: dict | None, extra: str = "") -> str:
    return f"{entry['path']}  ({entry['bytes']:,} bytes{extra})" if entry else "—"


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


# --- train --------------------------------------------------------------------------------------


def _is_flag(token: str, flag: str) -> bool:
    """Whether a command-line token is `flag`, whole or with `=VALUE` (the CLI takes no abbreviation)."""
    return token.split("=", 1)[0] == flag


def launcher() -> list[str]:
    """How this process was started, for the command that continues it: a rank that torchrun started
    continues under torchrun on as many processes (a run of many nodes also needs its rendezvous flags)."""
    from exactresume.world import launched_by_torchrun

    if not launched_by_torchrun():
        return ["exactresume"]
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    nodes = max(1, int(os.environ["WORLD_SIZE"]) // local)
    where = ["--standalone"] if nodes == 1 else ["--nnodes", str(nodes)]
    # `--` before the command, as docs/many-processes.md asks: torchrun would take --log for its own flag
    return ["torchrun", *where, "--nproc-per-node", str(local), "-m", "exactresume", "--"]


def continue_command(argv: list[str], resume: Path) -> str:
    """The user's own command without its stop (and --sharded, which only writes a stop), resuming from `resume`."""
    kept, skip_value = [], False
    for token in argv[1:] if argv[:1] == ["--"] else argv:  # the `--` a torchrun command put first: once
        if skip_value:
            skip_value = False
        elif _is_flag(token, "--stop-at") or _is_flag(token, "--resume"):
            skip_value = "=" not in token
        elif token != "--sharded":
            kept.append(token)
    return shlex.join([*launcher(), *kept, "--resume", str(resume)])


def log_rows(path: Path) -> list[list[str]]:
    lines = path.read_text().splitlines()[1:] if path.exists() else []
    return [line.split(",", 1) for line in lines if line]


def train_summary(job, argv: list[str], memory: dict | None = None) -> dict:
    """What `exactresume train` wrote (a TrainJob's outputs), the step its log reached and how to go on."""
    rows = log_rows(job.log_file)
    from exactresume.store.numbered import store_reading  # imports torch: only once a run is over

    reached = int(rows[-1][0]) if rows else None

    def newest(folder) -> dict | None:
        listed = store_reading(folder, notify=print).checkpoints()
        # the run's own: none past the step it reached (a file planted ahead, which its resume passed over)
        checkpoints = [checkpoint.path for checkpoint in listed if reached is None or checkpoint.step <= reached]
        return written(checkpoints[-1]) | {"count": len(checkpoints)} if checkpoints else None

    stopped = job.stop_at is not None
    files = {
        "resume": written(job.resume_file) if stopped else None,
        "weights": None if stopped else written(job.weights_file),
        "log": written(job.log_file) | {"rows": len(rows)} if job.log_file.exists() else None,
        # a run that saves none names none: what its folder holds is another run's (or an earlier one's)
        "checkpoint": newest(job.checkpoint_folder) if job.save_every else None,
        "local_checkpoint": newest(job.local_checkpoints) if job.local_checkpoints else None,
        "samples": written(job.samples) if job.samples else None,
        "divergence": written(job.divergence) if job.divergence else None,
    }
    return {
        "command": "train",
        "step": reached,
        "steps": job.config.steps,
        "stop_at": job.stop_at,
        "loss": float(rows[-1][1]) if rows else None,
        "files": {name: entry for name, entry in files.items() if entry},
        "continue": continue_command(argv, job.resume_file) if stopped else None,
        "memory": memory,  # peak_bytes of the run's largest process, and the plan's planned_bytes for one
    }


def render_train(summary: dict) -> list[str]:
    files = summary["files"]
    step = f"{summary['step']} of {summary['steps']}" if summary["step"] is not None else "no step trained"
    if summary["loss"] is not None:
        step += f", loss {summary['loss']:.4f}"
    if summary["stop_at"] is not None:
        step += f" (stopped by --stop-at {summary['stop_at']})"
    rows = [("step", step)]
    for name, label in (
        ("weights", "weights"),
        ("resume", "resume file"),
        ("log", "log"),
        ("samples", "samples"),
        ("divergence", "divergence"),
    ):
        if name in files:
            extra = f", {files[name]['rows']} rows" if name == "log" else ""
            rows.append((label, _file_text(files[name], extra)))
    # with a local tier, each tier's newest: where a resume looks first, and its fallback when the local one is lost
    tiers = "local_checkpoint" in files
    for name, label in (("local_checkpoint", "local checkpoint"), ("checkpoint", "durable checkpoint")):
        if name in files:
            label = label if tiers else "newest checkpoint"
            rows.append((label, _file_text(files[name], f", {files[name]['count']} kept")))
    if summary.get("memory"):
        peak, planned = summary["memory"]["peak_bytes"], summary["memory"]["planned_bytes"]
        rows.append(("memory", f"peak {peak / 1e6:,.0f} MB a process, planned {planned / 1e6:,.0f} MB"))
    if summary["continue"]:
        rows.append(("continue with", summary["continue"]))
    return aligned(rows)


# --- prepare ------------------------------------------------------------------------------------


def prepare_summary(out: Path, reused: bool) -> dict:
    """The prepared folder as its manifest.json describes it."""
    manifest = json.loads((out / "manifest.json").read_text())
    tokenizer = "trained byte-level BPE" if manifest["tokenizer_input_sha256"] is None else "the given tokenizer.json"
    names = ("tokenizer.json", "train.npy", "val.npy", "manifest.json")
    return {
        "command": "prepare",
        "corpus": manifest["corpus"],
        "documents": manifest["documents"],
        "train_tokens": manifest["train_tokens"],
        "val_tokens": manifest["val_tokens"],
        "tokenizer": f"{tokenizer}, {manifest['vocab_size']:,} tokens",
        "files": [written(out / name) for name in names],
        "reused": reused,
        "fingerprint": manifest["fingerprint"],
    }


def render_prepare(summary: dict) -> list[str]:
    rows = [
        ("corpus", f"{summary['corpus']}  ({summary['documents']:,} documents)"),
        ("tokens", f"{summary['train_tokens']:,} train, {summary['val_tokens']:,} val"),
        ("tokenizer", summary["tokenizer"]),
        ("cache", "reused (already prepared from the same inputs)" if summary["reused"] else "written now"),
    ]
    rows += [("file" if i == 0 else "", _file_text(entry)) for i, entry in enumerate(summary["files"])]
    folder = str(Path(summary["files"][0]["path"]).parent)
    rows.append(("next", shlex.join(["exactresume", "train", "--data", folder, "--out", "runs/a", "--stop-at", "30"])))
    return aligned(rows)


# --- lab ----------------------------------------------------------------------------------------

LAB_RUNS = ("resumed", "noopt", "noskip")


def lab_summary(folder: Path, shown: Path | None = None) -> dict:
    """The lab's findings from compare.json, optim.json, fp16.json and details/resume_sizes.json.

    Paths are given under `shown` (README.md shows docs/lab's copy as the runs/lab it came from).
    """
    folder, shown = Path(folder), Path(shown or folder)
    compare = json.loads((folder / "compare.json").read_text())
    runs = {
        name: {key: value for key, value in compare["runs"][name].items() if key != "loss_diffs"} for name in LAB_RUNS
    }
    figures = [name for name in FIGURE_NAMES if (folder / f"{name}.png").exists()]
    return {
        "command": "lab",
        "steps": compare["steps"],
        "stop_at": compare["stop_at"],
        "exact": runs["resumed"]["max_abs_diff"] == 0 and runs["resumed"]["log_rows_equal"],
        "runs": runs,
        "optimizer": json.loads((folder / "optim.json").read_text()),
        "fp16": json.loads((folder / "fp16.json").read_text()),
        "resume_sizes": _read_json(folder / "details" / "resume_sizes.json"),
        "ablation": str(shown / "ablation.json") if (folder / "ablation.json").exists() else None,
        "report": str(shown / "report.md"),
        "figures": [str(shown / f"{name}.png") for name in figures],
        "folder": str(shown),
    }


def verdict(summary: dict) -> str:
    resumed = summary["runs"]["resumed"]
    # compare.json counts the tensors it compared from 0.2 on; a copy from before says "every tensor"
    tensors = f"{resumed['tensors']} tensors" if "tensors" in resumed else "every tensor"
    if summary["exact"]:
        return f"resumed = straight: {tensors} bit-identical, every loss row equal"
    return f"resumed != straight: max abs weight difference {number(resumed['max_abs_diff'])}"


def render_lab(summary: dict) -> list[str]:
    header = ("against straight", "max abs Δweight", "rel. L2 Δweight", "Δfinal loss", "batches twice/never")
    rows = [
        (
            name,
            number(run["max_abs_diff"]),
            number(run["rel_l2"]),
            number(run["final_loss_diff"], signed=True),
            f"{run['batches_seen_twice']}/{run['batches_never_seen']}",
        )
        for name, run in summary["runs"].items()
    ]
    optim, fp16, sizes = summary["optimizer"], summary["fp16"], summary["resume_sizes"]
    facts = [
        (
            "optimizer/weights",
            f"{optim['optimizer_numel']:,} / {optim['model_numel']:,} elements = {optim['ratio']:.3f}",
        ),
        (
            "fp16/fp32 weights",
            f"{fp16['fp16_bytes']:,} / {fp16['fp32_bytes']:,} bytes ({fp16['size_ratio']:.3f}), "
            f"max logit difference {number(fp16['max_logit_diff'])}",
        ),
    ]
    if sizes:
        facts.append(
            (
                "resume file",
                f"{sizes['file_bytes']:,} bytes, {sizes['optimizer_moments_bytes']:,} of them AdamW moments",
            )
        )
    facts.append(("report", summary["report"]))
    facts += [("figures" if i == 0 else "", path) for i, path in enumerate(summary["figures"])]
    if summary["ablation"]:
        facts.append(("ablation", summary["ablation"]))
    folder = summary["folder"]
    facts.append(("check it", f"exactresume diff {folder}/straight.pth {folder}/resumed.pth"))
    title = f"{summary['steps']} steps, stopped after step {summary['stop_at']} and resumed in a new process"
    return [verdict(summary), f"({title})", "", *table(header, rows), "", *aligned(facts)]


# --- ablate -------------------------------------------------------------------------------------


def ablate_summary(out: Path) -> dict:
    """ablation.json's rows, as `exactresume ablate` wrote them."""
    ablation = json.loads((out / "ablation.json").read_text())
    keys = ("setup", "name", "part", "max_abs_diff", "final_loss_diff", "samples_seen_twice", "samples_never_seen")
    return {
        "command": "ablate",
        "steps": ablation["steps"],
        "stop_at": ablation["stop_at"],
        "rows": [{key: row[key] for key in keys} for row in ablation["rows"]],
        "files": [written(out / "ablation.json"), written(out / "ablation.md")],
    }


def render_ablate(summary: dict) -> list[str]:
    header = ("setup/variant", "part lost", "max abs Δweight", "Δfinal loss", "samples twice/never")
    rows = [
        (
            f"{row['setup']}/{row['name']}",
            row["part"] or "—",
            number(row["max_abs_diff"]),
            number(row["final_loss_diff"], signed=True),
            f"{row['samples_seen_twice']}/{row['samples_never_seen']}",
        )
        for row in summary["rows"]
    ]
    title = f"resumed at step {summary['stop_at']} of {summary['steps']}, one part of the resume file lost per row"
    files = [("wrote" if i == 0 else "", _file_text(entry)) for i, entry in enumerate(summary["files"])]
    return [title, "", *table(header, rows), "", *aligned(files)]
