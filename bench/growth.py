"""Growth: save and load time against the resume file's size across presets, and whether it is linear."""

from __future__ import annotations

LINEAR_TOLERANCE = 0.25  # per-GB costs of the files over MIN_GB may differ by this much and still be "linear"
MIN_GB = 0.1  # smaller files are dominated by fixed costs (opening, pickling, renaming, fsyncing a folder)


def _line(xs: list[float], ys: list[float]) -> dict:
    """Least-squares y = intercept + slope * x."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return {"seconds_per_gb": slope, "intercept_s": mean_y - slope * mean_x}


def _kind(presets: dict, kind: str) -> dict:
    gb = {name: p["resume_bytes"] / 1e9 for name, p in presets.items()}
    ours = {name: p[kind]["candidate_s"]["median"] for name, p in presets.items()}
    disk = {name: p[kind]["baseline_s"]["median"] for name, p in presets.items()}
    per_gb = {name: ours[name] / gb[name] for name in gb}
    large = [per_gb[name] for name in gb if gb[name] >= MIN_GB]
    linear = max(large) / min(large) - 1 <= LINEAR_TOLERANCE if len(large) >= 2 else None
    rates = ", ".join(
        f"{per_gb[n]:.2f} s/GB at {gb[n]:.2f} GB (disk {disk[n] / gb[n]:.2f})" for n in sorted(gb, key=gb.get)
    )
    verdict = {True: "linear", False: "not linear", None: "too few large files to say"}[linear]
    return {
        "gb": gb,
        "seconds": ours,
        "disk_seconds": disk,
        "s_per_gb": per_gb,
        "linear": linear,
        "fit": _line(list(gb.values()), list(ours.values())) if len(gb) >= 2 else None,
        "verdict": f"{kind}: {rates}: {verdict} (files over {MIN_GB} GB within {LINEAR_TOLERANCE:.0%} per GB)",
    }


def growth(presets: dict) -> dict:
    """Per-preset s/GB (written into each preset) and, per kind, the rates, a line and a verdict."""
    measured = {name: p for name, p in presets.items() if "save" in p and "load" in p}
    for _name, preset in measured.items():
        gb = preset["resume_bytes"] / 1e9
        preset["growth"] = {
            "save_s_per_gb": preset["save"]["candidate_s"]["median"] / gb,
            "load_s_per_gb": preset["load"]["candidate_s"]["median"] / gb,
        }
    return {kind: _kind(measured, kind) for kind in ("save", "load")} if measured else {}
