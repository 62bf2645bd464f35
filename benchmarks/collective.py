"""Refit over a weight-sync group. GPU (``vllm_gpu --part collective`` calls
``broadcast_floor``): the floor a refit from a trainer on another GPU is held to, a bare NCCL
broadcast of the same bytes between the same two GPUs in a process pair of its own (rollgen's
``SyncGroup`` is a plain torch process group). CPU (``python -m benchmarks.collective``): the
protocol (manifest, checks, buckets, loads) against a bare gloo broadcast of the same bytes."""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from typing import Any

import torch

from benchmarks.common import print_table, write_results
from rollgen.refit import WeightSpec
from rollgen.refit.transports.collective import SyncGroup, SyncGroupSpec, WeightSender, open_store, receive


def _receive(spec: SyncGroupSpec, device: int, sizes: list[int], rounds: int) -> None:
    torch.cuda.set_device(device)
    group = SyncGroup(spec, 1, torch.device("cuda", device))
    bufs = [torch.empty(n, dtype=torch.uint8, device=group.device) for n in sizes]
    for _ in range(rounds):
        for buf in bufs:
            group.broadcast(buf).wait()
        torch.cuda.synchronize()


def broadcast_floor(nbytes: int, sender: int, receiver: int, repeats: int, piece_bytes: int = 0) -> float:
    """Median seconds to broadcast ``nbytes`` from GPU ``sender`` (this process) to GPU
    ``receiver`` (a spawned process), in pieces of ``piece_bytes`` (0: one piece); two
    warm-up rounds first."""
    piece = piece_bytes or nbytes
    sizes = [min(piece, nbytes - start) for start in range(0, nbytes, piece)]
    store = open_store(SyncGroupSpec("127.0.0.1", 0, 2, "nccl", timeout_s=300), host=True)
    spec = SyncGroupSpec("127.0.0.1", store.port, 2, "nccl", timeout_s=300)
    rounds = repeats + 2
    child = multiprocessing.get_context("spawn").Process(
        target=_receive, args=(spec, receiver, sizes, rounds)
    )
    child.start()
    torch.cuda.set_device(sender)
    group = SyncGroup(spec, 0, torch.device("cuda", sender), store=store)
    bufs = [torch.empty(n, dtype=torch.uint8, device=group.device) for n in sizes]
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for buf in bufs:
            group.broadcast(buf).wait()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    child.join(120)
    del group, bufs
    torch.cuda.empty_cache()
    return statistics.median(times[2:])


def _receive_updates(spec: SyncGroupSpec, weights: WeightSpec, rounds: int) -> None:
    group = SyncGroup(spec, 1)
    state = {n: torch.empty(shape, dtype=getattr(torch, d)) for n, (shape, d) in weights.items()}

    def load(named: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named:
            state[name].copy_(tensor)

    for _ in range(rounds):
        receive(group, weights, load)


def protocol_overhead(mib: int, bucket_mib: list[int], repeats: int) -> list[dict[str, Any]]:
    """On CPU over gloo, a receiver in a spawned process: the time to send a random fp32 state
    of ``mib`` MiB through ``WeightSender.send`` (manifest, checks, buckets, loads into the
    receiver's tensors) by bucket size, against a bare gloo broadcast of the same bytes."""
    g = torch.Generator().manual_seed(0)
    state = {
        f"model.layers.{i}.mlp.down_proj.weight": torch.randn(1024, 256, generator=g) for i in range(mib)
    }
    weights = WeightSpec({n: (tuple(t.shape), "float32") for n, t in state.items()})
    nbytes = sum(t.numel() * 4 for t in state.values())
    rows = []
    floor = broadcast_floor_cpu(nbytes, repeats)
    for bucket in bucket_mib:
        sender = WeightSender(SyncGroupSpec("127.0.0.1", 0, 2, "gloo", timeout_s=300))
        rounds = repeats + 1
        child = multiprocessing.get_context("spawn").Process(
            target=_receive_updates, args=(sender.spec, weights, rounds)
        )
        child.start()
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            sender.send(state, bucket_bytes=bucket << 20)
            times.append(time.perf_counter() - start)
        child.join(120)
        med = statistics.median(times[1:])
        rows.append(
            {
                "bucket_mib": bucket,
                "gb": nbytes / 1e9,
                "send_ms": med * 1e3,
                "broadcast_ms": floor * 1e3,
                "vs_broadcast": med / floor,
            }
        )
    return rows


def _receive_bare(spec: SyncGroupSpec, nbytes: int, rounds: int) -> None:
    group = SyncGroup(spec, 1)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(rounds):
        group.broadcast(buf).wait()


def broadcast_floor_cpu(nbytes: int, repeats: int) -> float:
    """Median seconds of a bare gloo broadcast of ``nbytes`` to a spawned process."""
    store = open_store(SyncGroupSpec("127.0.0.1", 0, 2, "gloo", timeout_s=300), host=True)
    spec = SyncGroupSpec("127.0.0.1", store.port, 2, "gloo", timeout_s=300)
    rounds = repeats + 1
    child = multiprocessing.get_context("spawn").Process(target=_receive_bare, args=(spec, nbytes, rounds))
    child.start()
    group = SyncGroup(spec, 0, store=store)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        group.broadcast(buf).wait()
        times.append(time.perf_counter() - start)
    child.join(120)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description="CPU: the weight-sync protocol against a bare gloo broadcast"
    )
    parser.add_argument("--mib", type=int, default=512, help="size of the state, MiB")
    parser.add_argument("--bucket-mib", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="out/benchmarks")
    args = parser.parse_args()
    rows = protocol_overhead(args.mib, args.bucket_mib, args.repeats)
    print_table(rows, list(rows[0]))
    write_results("collective_cpu", rows, args.out)


if __name__ == "__main__":
    main()
