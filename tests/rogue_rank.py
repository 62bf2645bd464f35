"""A stand-in attacker for the weight-sync tests: a process that reaches a group's store but
holds no secret. ``python tests/rogue_rank.py ADDRESS PORT WORLD_SIZE RANK MARKER`` joins the
group as RANK (first: it writes that it came, then ``rogue-ready`` to the store just before), plays
the members' authentication with a made-up secret, then tries what earlier versions of rollgen
fell to: a pickle, broadcast as a manifest (rank 0) or as an error (any other rank), whose
unpickling would create the file MARKER. It exits when the group turns it away (its collectives
fail) or is killed."""

from __future__ import annotations

import os
import pickle
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


class Payload:
    """Unpickling this creates the marker file: code of the rogue's choosing, run by the victim."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (open, (self.marker, "w"))


def main(address: str, port: int, world_size: int, rank: int, marker: str) -> None:
    timeout = timedelta(seconds=20)
    store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout, wait_for_workers=False)
    store.set(f"rollgen-weight-sync/joined/{rank}", "1")  # says it came, as a member does
    store.set("rogue-ready", "1")
    pg = dist.ProcessGroupGloo(dist.PrefixStore("rollgen-weight-sync", store), rank, world_size, timeout)
    # the members' authentication, with a made-up tag
    for _ in range(2):
        mine = torch.frombuffer(bytearray(os.urandom(32)), dtype=torch.uint8)
        pg.allgather([[torch.empty_like(mine) for _ in range(world_size)]], [mine]).wait()
    # the old attack: a pickle where a manifest or an error travels
    if rank != 0:  # claim an error, as the lowest rank with one
        claim = torch.tensor([world_size - rank], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
        pg.allreduce([claim], options).wait()
    data = pickle.dumps(Payload(marker))
    options = dist.BroadcastOptions()
    options.rootRank = rank
    pg.broadcast([torch.tensor([len(data)], dtype=torch.int64)], options).wait()
    pg.broadcast([torch.frombuffer(bytearray(data), dtype=torch.uint8)], options).wait()


if __name__ == "__main__":
    address, port, world_size, rank, marker = sys.argv[1:6]
    try:
        main(address, int(port), int(world_size), int(rank), marker)
    except RuntimeError:  # turned away: its collectives fail
        sys.exit(3)
