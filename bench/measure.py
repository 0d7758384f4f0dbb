"""Timing and memory tools shared by the benchmarks: interleaved repetitions, medians, peak RSS."""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

# A trial runs its candidate once and returns the seconds it measured itself (so setup and
# cleanup stay outside the figure).
Trial = Callable[[], float]


@dataclass(frozen=True)
class Summary:
    """Median and range of repeated measurements (seconds unless said otherwise)."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Summary:
        return cls(statistics.median(values), min(values), max(values), len(values))

    def to_dict(self) -> dict:
        return asdict(self)


def timed(action: Callable[[], object]) -> float:
    """Wall seconds `action()` takes."""
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def interleave(
    trials: dict[str, Trial], reps: int, warmup: int = 1, deadline: float | None = None
) -> dict[str, list[float]]:
    """Run every trial once per round, rotating the order each round; warm-up rounds are dropped.

    Rotating (A B C, B C A, C A B, ...) keeps any trial from always following the same one. With a
    `deadline` (a time.perf_counter() value), no round starts that the last one says would end
    after it, once one round is measured."""
    names = list(trials)
    results: dict[str, list[float]] = {name: [] for name in names}
    last_round = 0.0
    for round_number in range(warmup + reps):
        started = time.perf_counter()
        if deadline is not None and round_number > warmup and started + last_round > deadline:
            break
        shift = round_number % len(names)
        for name in names[shift:] + names[:shift]:
            seconds = trials[name]()
            if round_number >= warmup:
                results[name].append(seconds)
        last_round = time.perf_counter() - started
    return results


def ratio(candidate: list[float], baseline: list[float]) -> dict:
    """candidate / baseline: the median and range of the round-by-round ratios, and both medians.

    Each round's two measurements were taken one after the other, so their ratio cancels most of
    what the machine's other jobs did to both; the median of those ratios is the figure."""
    per_round = [c / b for c, b in zip(candidate, baseline)]
    return {
        "ratio": statistics.median(per_round),
        "round_min": min(per_round),
        "round_max": max(per_round),
        "candidate_s": Summary.of(candidate).to_dict(),
        "baseline_s": Summary.of(baseline).to_dict(),
    }


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE).group(1))


def rss_bytes() -> int:
    """This process's resident set size now."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """The largest resident set size since the last reset_peak_rss()."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Start a new peak-RSS window (Linux: writing 5 to clear_refs resets VmHWM to the current RSS)."""
    Path("/proc/self/clear_refs").write_text("5")


def load_average() -> float:
    """The 1-minute load average: how busy the shared machine was."""
    return float(Path("/proc/loadavg").read_text().split()[0])
