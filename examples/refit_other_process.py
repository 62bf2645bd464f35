"""Refit from a trainer in another process (another GPU, another host, or CPU): a weight-sync
group of the engines' own. The trainer's sending rank hosts it (rank 0) and broadcasts each
update; every engine rank (all TP ranks of all DP replicas) receives it. gloo on CPU, NCCL on
CUDA.

    python examples/refit_other_process.py [--backend hf|vllm]
"""

from __future__ import annotations

import argparse
import multiprocessing
from multiprocessing.connection import Connection

import torch

import rollgen
from rollgen.testing import load_reference_model
from rollgen.testing.config import tiny_config
from rollgen.testing.tiny_model import tiny_model_dir


def trainer(spec: rollgen.SyncGroupSpec, listening: Connection, steps: int) -> None:
    """The trainer's sending rank: hosts the group, joins it, then sends the weights after each
    step."""
    sender = rollgen.WeightSender(spec)  # listens at once; spec.port 0: on a free port
    listening.send(sender.spec)  # the spec with that port, for the generation
    sender.connect()  # returns once every engine rank has joined
    model = load_reference_model(tiny_model_dir())
    for _ in range(steps):
        with torch.no_grad():  # a stand-in for a training step
            for p in model.parameters():
                p.mul_(1.01)
        sender.send(model)  # validated by every engine rank before any byte is applied


def main(backend: str, steps: int = 2) -> None:
    prompt = {"input_ids": torch.tensor([[5, 6, 7]]), "input_lengths": torch.tensor([3])}
    with rollgen.create_generation(tiny_config(backend, tiny_model_dir(), max_new_tokens=4)) as gen:
        spec = gen.weight_sync_spec("127.0.0.1")  # the trainer's host; world size, backend, timeout
        listening, tell = multiprocessing.Pipe()
        process = multiprocessing.get_context("spawn").Process(target=trainer, args=(spec, tell, steps))
        process.start()
        gen.init_weight_sync(listening.recv())  # returns once the trainer has joined too
        for step in range(steps):
            gen.update_weights_from_collective()  # pairs with the trainer's send
            out = gen.generate(prompt, greedy=True)
            print(f"step {step}: logprobs {out['logprobs'][0, 3:].tolist()}")
        process.join()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="hf")
    main(parser.parse_args().backend)
