"""Streaming `prepare` on a generated corpus: peak memory, and MB/s against tokenizers' own encode_batch.

    python -m bench.prepare --mb 400 --folder /tmp/p     # prints one JSON object; --mb 2048 for the goal size

The corpus is the KJV's verses in 8-verse passages, one `{"text": ...}` line each, repeated in a
new deterministic order per pass until it holds `--mb` MB. Each figure comes from a fresh process:
`prepare` with the given tokenizer (reading, parsing, encoding, writing and hashing all counted),
and the baseline, tokenizers' `encode_batch` on the same documents in 1 MB batches, timing only
the encode_batch calls (reading and parsing the corpus are left out of the baseline). Peaks are
the kernel's high-water mark (VmHWM) of each process.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from itertools import chain
from pathlib import Path

from exactresume.core.corpus import default_corpus_path, documents, lines
from exactresume.core.data import PrepareConfig, prepare

from .measure import load_average, peak_rss_bytes

ROOT = Path(__file__).resolve().parents[1]
# MiniMind's tokenizer beside the checkout (../shared), or beside the folder holding it.
MINIMIND_TOKENIZER = next(
    (
        path
        for path in (ROOT.parent / "shared/minimind/tokenizer.json", ROOT.parents[1] / "shared/minimind/tokenizer.json")
        if path.is_file()
    ),
    ROOT.parent / "shared/minimind/tokenizer.json",
)
PASSAGE_VERSES = 8
BASELINE_BATCH = 1 << 20  # as prepare batches its documents


def make_corpus(path: Path, megabytes: float) -> int:
    """Write the generated corpus (see the module docstring); its size in bytes."""
    verses = [json.loads(line)["text"] for _, line, _ in lines(default_corpus_path(), 1 << 22) if line.strip()]
    passages = [" ".join(verses[i : i + PASSAGE_VERSES]) for i in range(0, len(verses), PASSAGE_VERSES)]
    order, size, target = random.Random(0), 0, megabytes * 1e6
    with open(path, "w", encoding="utf-8") as file:
        while size < target:
            order.shuffle(passages)
            for passage in passages:
                line = json.dumps({"text": passage}, ensure_ascii=False) + "\n"
                file.write(line)
                size += len(line.encode())
                if size >= target:
                    break
    return size


def cpu_seconds() -> float:
    """CPU time of this process, all its threads (tokenizers' included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child_prepare(corpus: Path, tokenizer: Path, out: Path) -> dict:
    started, cpu = time.perf_counter(), cpu_seconds()
    prepare(PrepareConfig(corpus=corpus, tokenizer=tokenizer), out, log=lambda line: None)
    return {"seconds": time.perf_counter() - started, "cpu_s": cpu_seconds() - cpu, "peak_rss_bytes": peak_rss_bytes()}


def child_encode(corpus: Path, tokenizer_path: Path) -> dict:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    encoding, cpu, batch, size = 0.0, 0.0, [], 0
    for document in chain(documents(corpus), [None]):  # None: flush the last batch
        if document is not None:
            batch.append(document)
            size += len(document)
        if batch and (size >= BASELINE_BATCH or document is None):
            started, cpu_before = time.perf_counter(), cpu_seconds()
            tokenizer.encode_batch(batch, add_special_tokens=False)
            encoding += time.perf_counter() - started
            cpu += cpu_seconds() - cpu_before
            batch, size = [], 0
    return {"seconds": encoding, "cpu_s": cpu, "peak_rss_bytes": peak_rss_bytes()}


def in_child(*args: str) -> dict:
    command = [sys.executable, "-m", "bench.prepare", "--child", *args]
    finished = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if finished.returncode != 0:
        raise RuntimeError(f"{command} failed:\n{finished.stderr}")
    return json.loads(finished.stdout)


def bench_prepare(megabytes: float, folder: Path, tokenizer: Path, baseline: bool = True) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "corpus.jsonl"
    size = make_corpus(corpus, megabytes)
    load_before = load_average()
    candidate = in_child("prepare", str(corpus), str(tokenizer), str(folder / "out"))
    figures = {
        "corpus_mb": size / 1e6,
        "tokenizer": str(tokenizer),
        "prepare_mb_per_s": size / 1e6 / candidate["seconds"],
        "prepare_peak_rss_mb": candidate["peak_rss_bytes"] / 1e6,
        "prepare_s": candidate["seconds"],
        "load_average": [load_before, load_average()],
    }
    if not baseline:
        return figures
    baseline = in_child("encode", str(corpus), str(tokenizer))
    return figures | {
        "encode_batch_mb_per_s": size / 1e6 / baseline["seconds"],
        "throughput_ratio": baseline["seconds"] / candidate["seconds"],
        # CPU seconds are less sensitive than wall time to other jobs on a shared machine.
        "cpu_ratio": baseline["cpu_s"] / candidate["cpu_s"],
        "encode_batch_peak_rss_mb": baseline["peak_rss_bytes"] / 1e6,
        "encode_batch_s": baseline["seconds"],
        "load_average": [load_before, load_average()],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=2048, help="size of the generated corpus")
    parser.add_argument("--folder", type=Path, default=Path("runs/bench-prepare"))
    parser.add_argument("--tokenizer", type=Path, default=MINIMIND_TOKENIZER)
    parser.add_argument("--no-baseline", action="store_true", help="prepare only (memory at a large size)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, *paths = args.child
        result = child_prepare(*map(Path, paths)) if kind == "prepare" else child_encode(*map(Path, paths))
    else:
        result = bench_prepare(args.mb, args.folder, args.tokenizer, baseline=not args.no_baseline)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
