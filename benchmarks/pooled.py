"""Paired ratios pooled over several throughput runs: one contestant against a baseline, round
by round, from the JSON files ``throughput.measure`` rows were saved in; the median and a
bootstrap 95% interval of it (how far the runs' noise lets them pin the ratio down).

    python -m benchmarks.pooled FILE... [--contestant rollgen] [--baseline raw raw_in_actor]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

from benchmarks.common import print_table
from benchmarks.throughput import paired_ratios


def row_ratios(row: dict[str, Any], contestant: str, baselines: list[str]) -> tuple[str, list[float]]:
    """The contestant's paired ratios in one ``throughput.measure`` row, against the first of
    ``baselines`` the row has."""
    base = next((b for b in baselines if f"{b}_times_s" in row), None)
    if base is None or f"{contestant}_times_s" not in row:
        raise ValueError(
            f"row {row.get('mode')!r} lacks per-round times of {contestant!r} or any of {baselines}"
        )
    return base, paired_ratios(
        row[f"tokens_{base}"],
        row[f"{base}_times_s"],
        row[f"tokens_{contestant}"],
        row[f"{contestant}_times_s"],
    )


def median_interval(ratios: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of the median (seeded: the same files give the same
    interval)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def pool(files: list[Path], contestant: str, baselines: list[str]) -> list[dict[str, Any]]:
    """One row per measured row of each file, then the pooled row."""
    rows, pooled = [], []
    for path in files:
        for row in json.loads(path.read_text())["rows"]:
            base, ratios = row_ratios(row, contestant, baselines)
            pooled += ratios
            rows.append({"run": f"{path.name}:{row['mode']}", "baseline": base, **summary(ratios)})
    return rows + [{"run": "pooled", "baseline": "-", **summary(pooled)}]


def summary(ratios: list[float]) -> dict[str, Any]:
    low, high = median_interval(ratios)
    return {"rounds": len(ratios), "median": statistics.median(ratios), "ci95_low": low, "ci95_high": high}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--contestant", default="rollgen")
    parser.add_argument(
        "--baseline", nargs="+", default=["raw", "raw_in_actor"], help="the first of these a row has"
    )
    args = parser.parse_args()
    try:
        rows = pool(args.files, args.contestant, args.baseline)
    except ValueError as e:  # files saved before rounds were kept (before 2a571d5), or a typo
        parser.error(str(e))
    print_table(rows, list(rows[0]))


if __name__ == "__main__":
    main()
