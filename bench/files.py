"""Resume-file figures: a sealed save and a verified load vs the disk and vs plain torch moving the same bytes.

Save: `save_resume` (atomic: tmp file, fsync, rename, folder fsync; checksummed, read back) vs one
`write` of as many bytes from a warm buffer plus `fsync`, and vs a plain `torch.save` + `fsync` of the same state;
safetensors on the same tensors for comparison. Load: `read_resume_file` (checksum, then deserialize) vs
reading the file's bytes into newly allocated memory, and vs a plain `torch.load` of the plain
`torch.save` file followed by the xxh3 of its bytes; all from the page cache (the files were just
written). On this VM fresh memory costs about as much as the copy (MACHINE-NOTES), and torch.load's
many tensor-sized allocations can reuse memory the allocator kept while one file-sized buffer cannot;
so the read into memory already touched is reported too, as the page cache's own speed.

Goals (GOALS): on the 26M and 64M presets, whose files are hundreds of MB, the save within 1.25× of
the disk's write and the load within 1.5× of its read; on the default preset, whose file is about
20 MB and fixed costs weigh, no slower than plain torch (each within 1.1×).

`python -m bench.files --presets default,minimind-26m` measures these figures and the memory of
training, saving and resuming (bench/memory.py) alone, on a run trained one step, and prints them as
JSON; `--merge docs/bench.json` puts them into a full run's figures, saying when they were measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import xxhash
from safetensors.torch import load_file, save_file

from exactresume.atomic import fsync_path
from exactresume.config import TrainConfig
from exactresume.core.data import ensure_data, load_tokens
from exactresume.store.access import save_resume
from exactresume.store.resume import capture, read_resume_file
from exactresume.training.loop import Run, build_run, train_step

from .measure import Trial, interleave, load_average, ratio, timed
from .memory import memory_figures

# (figure, baseline) -> the goal, per preset; a figure without a goal on a preset is shown, not judged.
LARGE = ("minimind-26m", "minimind-64m")
GOALS = {
    ("save", "disk"): (1.25, LARGE),
    ("save", "torch_save"): (1.1, ("default",)),
    ("load", "disk"): (1.5, LARGE),
    ("load", "torch_load_xxh3"): (1.1, ("default",)),
}


def judged(figure: dict, kind: str, baseline: str, preset: str) -> dict:
    """`figure` with its goal and whether it is met, where this preset has one."""
    goal, presets = GOALS[(kind, baseline)]
    if preset not in presets:
        return figure | {"goal": None, "met": None}
    return figure | {"goal": f"<= {goal}", "met": figure["ratio"] <= goal}


def write_and_fsync(path: Path, data: memoryview) -> None:
    """The disk's figure: one write of all the bytes (looping only on a short write), then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def read_into_fresh_memory(path: Path) -> torch.Tensor:
    """The disk's figure for loading: the file's bytes in newly allocated memory (not zero-filled)."""
    with open(path, "rb", buffering=0) as file:
        buffer = torch.empty(os.fstat(file.fileno()).st_size, dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        done = 0
        while done < len(view):
            done += file.readinto(view[done:])
    return buffer


def read_into(path: Path, buffer: torch.Tensor) -> None:
    """The page cache's copy speed: the file's bytes into memory already touched (no page faults)."""
    view = memoryview(buffer.numpy())
    with open(path, "rb", buffering=0) as file:
        done = 0
        while done < len(view):
            done += file.readinto(view[done:])


def flat_tensors(state: dict) -> dict[str, torch.Tensor]:
    """The resume state's tensors under flat names (tied weights once), as safetensors needs."""
    flat: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def visit(prefix: str, value: object) -> None:
        if isinstance(value, torch.Tensor):
            if value.data_ptr() not in seen or value.numel() == 0:
                seen.add(value.data_ptr())
                flat[prefix] = value.contiguous()
        elif isinstance(value, dict):
            for key, item in value.items():
                visit(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                visit(f"{prefix}.{index}", item)

    visit("", state)
    return flat


def removing(path: Path, action) -> Trial:
    """A trial: delete `path` (untimed), then time `action()`, which writes it anew."""

    def trial() -> float:
        path.unlink(missing_ok=True)
        return timed(action)

    return trial


def bench_save(run: Run, folder: Path, reps: int) -> dict:
    resume, state, preset = folder / "resume.pth", capture(run.parts()), run.config.preset
    save_resume(resume, run.parts())
    size = resume.stat().st_size
    disk_buffer = torch.ones(size, dtype=torch.uint8)  # touched: warm memory, like the state's tensors
    flat = flat_tensors(state)
    paths = {name: folder / f"{name}.bin" for name in ("disk", "torch_save", "safetensors")}
    trials = {
        "sealed": removing(resume, lambda: save_resume(resume, run.parts())),
        "disk": removing(paths["disk"], lambda: write_and_fsync(paths["disk"], memoryview(disk_buffer.numpy()))),
        "torch_save": removing(
            paths["torch_save"], lambda: (torch.save(state, paths["torch_save"]), fsync_path(paths["torch_save"]))
        ),
        "safetensors": removing(
            paths["safetensors"], lambda: (save_file(flat, paths["safetensors"]), fsync_path(paths["safetensors"]))
        ),
    }
    times = interleave(trials, reps)
    sizes = {"sealed": resume.stat().st_size} | {name: path.stat().st_size for name, path in paths.items()}
    for name in ("disk", "safetensors"):
        paths[name].unlink()
    paths["torch_save"].rename(folder / "plain.pth")  # bench_load's plain torch file
    return {
        "resume_bytes": size,
        "save_vs_disk_ratio": ratio(times["sealed"], times["disk"])["ratio"],
        "save": judged(ratio(times["sealed"], times["disk"]), "save", "disk", preset)
        | {
            "bytes": sizes,
            "vs_torch_save": judged(ratio(times["sealed"], times["torch_save"]), "save", "torch_save", preset),
            "torch_save_vs_disk_ratio": ratio(times["torch_save"], times["disk"]),
            "safetensors_vs_disk_ratio": ratio(times["safetensors"], times["disk"]),
            "what": "save_resume (atomic, fsynced, checksummed, read back) / one write + fsync of as many bytes; "
            "vs_torch_save: / a plain torch.save of the same state + fsync",
        },
    }


def torch_load_and_xxh3(path: Path) -> object:
    """The plain way to a verified state: torch.load, then the xxh3 of the file's bytes."""
    state = torch.load(path, weights_only=True, map_location="cpu")
    digest = xxhash.xxh3_128()
    with open(path, "rb") as file:
        while chunk := file.read(8 << 20):
            digest.update(chunk)
    return state


def bench_load(folder: Path, reps: int, preset: str) -> dict:
    resume, plain, tensors = folder / "resume.pth", folder / "plain.pth", folder / "load.safetensors"
    save_file(flat_tensors(read_resume_file(resume)), tensors)
    warm = torch.ones(resume.stat().st_size, dtype=torch.uint8)
    trials = {
        "verified": lambda: timed(lambda: read_resume_file(resume)),
        "disk": lambda: timed(lambda: read_into_fresh_memory(resume)),
        "disk_warm_memory": lambda: timed(lambda: read_into(resume, warm)),
        "torch_load": lambda: timed(lambda: torch.load(resume, weights_only=True, map_location="cpu")),
        "torch_load_xxh3": lambda: timed(lambda: torch_load_and_xxh3(plain)),
        "safetensors": lambda: timed(lambda: load_file(tensors)),
    }
    times = interleave(trials, reps)
    tensors.unlink()
    plain.unlink()
    return {
        "load_vs_disk_ratio": ratio(times["verified"], times["disk"])["ratio"],
        "load": judged(ratio(times["verified"], times["disk"]), "load", "disk", preset)
        | {
            "vs_torch_load_xxh3": judged(
                ratio(times["verified"], times["torch_load_xxh3"]), "load", "torch_load_xxh3", preset
            ),
            "torch_load_vs_disk_ratio": ratio(times["torch_load"], times["disk"]),
            "safetensors_vs_disk_ratio": ratio(times["safetensors"], times["disk"]),
            "verified_vs_warm_memory_read_ratio": ratio(times["verified"], times["disk_warm_memory"]),
            "what": "read_resume_file (checksum + weights_only deserialize) / reading the bytes into newly "
            "allocated memory (as any loader must); vs_torch_load_xxh3: / a plain torch.load of the plain "
            "torch.save file, then the xxh3 of its bytes; page cache warm. safetensors maps the file "
            "and copies nothing until a tensor is touched",
        },
    }


MERGED_KEYS = ("resume_bytes", "save_vs_disk_ratio", "save", "load_vs_disk_ratio", "load", "memory")


def merge(figures: dict, bench_json: Path) -> None:
    """Put this run's file and memory figures into a full run's bench.json, saying when they were measured."""
    bench = json.loads(bench_json.read_text())
    for name, preset in bench["presets"].items():
        if name in figures:
            preset.update({key: figures[name][key] for key in MERGED_KEYS})
    bench["files_rerun"] = {
        "date": datetime.date.today().isoformat(),
        "command": "python -m bench.files --presets " + ",".join(n for n in bench["presets"] if n in figures),
        "load_average_before": figures["load_average_before"],
        "load_average_after": figures["load_average_after"],
        "reps": figures["reps"],
    }
    bench_json.write_text(json.dumps(bench, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    """The resume-file and memory figures alone, per preset, on a run trained one step (no training figures)."""
    parser = argparse.ArgumentParser(description="save and load of the resume file vs the disk, per preset")
    parser.add_argument("--data", type=Path, default=Path("data/kjv"), help="prepared data (made if missing)")
    parser.add_argument("--presets", default="default", help="comma-separated preset names")
    parser.add_argument("--reps", type=int, default=5, help="measured rounds per figure (after one warm-up)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--merge", type=Path, help="a full run's bench.json to update with these figures")
    args = parser.parse_args(argv)
    ensure_data(args.data)
    data, figures = load_tokens(args.data), {"load_average_before": load_average(), "reps": args.reps}
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.presets.split(","):
            config = TrainConfig(steps=10**6, batch=args.batch, seq_len=args.seq_len, preset=name)
            run = build_run(config, data)
            train_step(run)
            figures[name] = bench_save(run, Path(scratch), args.reps) | bench_load(Path(scratch), args.reps, name)
            (Path(scratch) / "resume.pth").unlink()
            del run
            figures[name]["memory"] = memory_figures(config, args.data, Path(scratch))
            save, load = figures[name]["save_vs_disk_ratio"], figures[name]["load_vs_disk_ratio"]
            print(f"{name}: save {save:.2f}, load {load:.2f}", file=sys.stderr)
    figures["load_average_after"] = load_average()
    print(json.dumps(figures, indent=2))
    if args.merge:
        merge(figures, args.merge)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
