"""Refit over a weight-sync group (NCCL) from a trainer on another GPU: the floor it is held
to, a bare NCCL broadcast of the same bytes between the same two GPUs, in a process pair of
its own (rollgen's ``SyncGroup`` is a plain torch process group)."""

from __future__ import annotations

import multiprocessing
import statistics
import time

import torch

from rollgen.testing.trainer import free_port
from rollgen.weight_sync import SyncGroup, SyncGroupSpec


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
    spec = SyncGroupSpec("127.0.0.1", free_port(), 2, "nccl", timeout_s=300)
    rounds = repeats + 2
    child = multiprocessing.get_context("spawn").Process(
        target=_receive, args=(spec, receiver, sizes, rounds)
    )
    child.start()
    torch.cuda.set_device(sender)
    group = SyncGroup(spec, 0, torch.device("cuda", sender))
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
