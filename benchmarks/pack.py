"""The driver's per-tensor cost of packing one bucket (``rollgen.refit.pack_bucket``: the copy
into one shared-memory buffer, the views of it, the finite check): many small tensors, so that
the per-tensor Python shows rather than the bytes. An adapter of rank 64 on every linear layer of
the 1.5B shape is 392 tensors in one bucket.

    python -m benchmarks.pack --tensors 392 --repeats 50 --out $OUT
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.common import print_table, timed, write_results
from rollgen.refit import pack_bucket


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tensors", type=int, default=392)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default="out/benchmarks")
    args = parser.parse_args()
    named = [(f"t{i}.lora_A.weight", torch.randn(8, 16)) for i in range(args.tensors)]
    for _ in range(3):
        pack_bucket(named, "shared_memory")
    times = [timed(lambda: pack_bucket(named, "shared_memory")) for _ in range(args.repeats)]
    ms = 1e3 * statistics.median(times)
    row = {
        "tensors": args.tensors,
        "pack_ms": ms,
        "us_per_tensor": 1e3 * ms / args.tensors,
        "pack_ms_min": 1e3 * min(times),
    }
    print_table([row], list(row))
    print(f"results: {write_results('pack', [row], args.out)}")


if __name__ == "__main__":
    main()
