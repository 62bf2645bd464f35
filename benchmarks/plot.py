"""PNG plots of recorded benchmark results (the JSON the runners write), for BENCHMARKS.md.

pip install 'rollgen[bench]'
python -m benchmarks.plot results/benchmarks/2026-11-30-h200-c30eed2 --out docs/img
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def load(results: Path, name: str) -> dict[str, Any]:
    return json.loads((results / f"{name}.json").read_text())


def refit_vs_bucket(results: Path, out: Path) -> Path:
    """Refit time by bucket size (median with min–max), against the device-to-device copy floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = load(results, "vllm_gpu_refit_by_bucket")
    rows = sorted((r for r in data["rows"] if not r.get("default")), key=lambda r: r["bucket_mib"])
    x = [r["bucket_mib"] for r in rows]
    med = [r["refit_ms"] for r in rows]
    err = [
        [m - r["refit_ms_min"] for m, r in zip(med, rows)],
        [r["refit_ms_max"] - m for m, r in zip(med, rows)],
    ]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.errorbar(x, med, yerr=err, marker="o", capsize=3, label="rollgen refit (CUDA IPC, end to end)")
    ax.axhline(rows[0]["d2d_copy_ms"], color="gray", linestyle="--", label="floor: one D2D copy of the bytes")
    ax.axhline(25, color="red", linestyle=":", label="target 25 ms")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bucket size (MiB)")
    ax.set_ylabel("ms per full refit")
    ax.set_title(
        f"Refit of {rows[0]['gb']:.2f} GB ({rows[0]['tensors']} tensors), {data['machine'].get('gpu', 'CPU')}"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "refit_vs_bucket.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def throughput_vs_batch(results: Path, out: Path) -> Path:
    """Output tokens/s by batch size, raw vLLM and rollgen (median, min–max), and their paired
    ratio on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = load(results, "vllm_gpu_sweep_throughput")
    rows = sorted(data["rows"], key=lambda r: r["batch"])
    x = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("raw", "rollgen"):
        med = [r[f"{name}_tok_s"] for r in rows]
        err = [
            [m - r[f"{name}_tok_s_min"] for m, r in zip(med, rows)],
            [r[f"{name}_tok_s_max"] - m for m, r in zip(med, rows)],
        ]
        label = "raw vLLM" if name == "raw" else "rollgen-vLLM"
        ax.errorbar(x, med, yerr=err, marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompts per generate call")
    ax.set_ylabel("output tokens/s")
    ratio = ax.twinx()
    ratio.plot(x, [r["rollgen_ratio"] for r in rows], color="gray", linestyle="--", marker=".")
    ratio.axhline(0.99, color="red", linestyle=":")
    ratio.set_ylabel("rollgen / raw (paired; dotted: 0.99 target)")
    ax.set_title(f"Throughput by batch size, CUDA graphs, {data['machine'].get('gpu', 'CPU')}")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path = out / "throughput_vs_batch.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


#: Each plot and the result file it needs; main draws those whose file is in the folder.
PLOTS = {
    "vllm_gpu_refit_by_bucket": refit_vs_bucket,
    "vllm_gpu_sweep_throughput": throughput_vs_batch,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", type=Path, help="a folder of result JSON files")
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, plot in PLOTS.items():
        if (args.results / f"{name}.json").exists():
            print(plot(args.results, args.out))


if __name__ == "__main__":
    main()
