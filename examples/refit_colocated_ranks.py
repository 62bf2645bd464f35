"""Refit from a trainer of several processes colocated with the engines (FSDP or Megatron ranks
on the engines' GPUs): each rank packs CUDA IPC buckets of the full tensors on its own GPU, the
driver merges them, and each engine rank maps its GPU's buffer. Needs two GPUs.

    python examples/refit_colocated_ranks.py
"""

from __future__ import annotations

import multiprocessing
import pickle
from multiprocessing.connection import Connection

import torch

import rollgen
from rollgen.testing import load_reference_model
from rollgen.testing.config import tiny_config
from rollgen.testing.tiny_model import tiny_model_dir


def trainer_rank(rank: int, conn: Connection) -> None:
    """One trainer rank: the full weights on its GPU (as FSDP holds them after an all-gather)."""
    torch.cuda.set_device(rank)
    model = load_reference_model(tiny_model_dir(), torch.bfloat16).cuda(rank)
    conn.send(pickle.dumps(list(rollgen.iter_buckets(model, "cuda_ipc"))))
    conn.recv()  # keep the buffers alive until the driver has applied the update


def main() -> None:
    config = tiny_config("vllm", tiny_model_dir(), max_new_tokens=4, dtype="bfloat16")
    config["vllm_cfg"] = {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.2}
    context = multiprocessing.get_context("spawn")
    with rollgen.create_generation(config) as gen:
        pipes = [context.Pipe() for _ in range(2)]
        ranks = [context.Process(target=trainer_rank, args=(r, pipes[r][1])) for r in range(2)]
        for p in ranks:
            p.start()
        per_rank = [pickle.loads(parent.recv()) for parent, _ in pipes]
        gen.update_weights(rollgen.merge_buckets(per_rank))
        for parent, _ in pipes:
            parent.send("done")
        for p in ranks:
            p.join()
        print(gen.generate({"input_ids": torch.tensor([[5, 6, 7]]), "input_lengths": torch.tensor([3])}))


if __name__ == "__main__":
    main()
