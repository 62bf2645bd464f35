"""Refit, one trainer process colocated with the engines: ``gen.refit(model)`` packs buckets
here and sends them over the backend's local transport (in-process tensors for ``hf``, shared
memory for vLLM on CPU, CUDA IPC on GPUs: one handle per engine GPU this process can see).

    python examples/refit_one_process.py [--backend hf|vllm]
"""

from __future__ import annotations

import argparse

import torch

import rollgen
from rollgen.testing import load_reference_model
from rollgen.testing.config import tiny_config
from rollgen.testing.tiny_model import tiny_model_dir


def main(backend: str) -> None:
    model_dir = tiny_model_dir()
    trainer = load_reference_model(model_dir)  # the policy being trained (here: the served weights)
    prompt = {"input_ids": torch.tensor([[5, 6, 7]]), "input_lengths": torch.tensor([3])}
    with rollgen.create_generation(tiny_config(backend, model_dir, max_new_tokens=4)) as gen:
        before = gen.generate(prompt, greedy=True)
        with torch.no_grad():  # a stand-in for a training step
            for p in trainer.parameters():
                p.mul_(1.01)
        gen.refit(trainer, dtype=gen.engine_dtype)
        after = gen.generate(prompt, greedy=True)
    print("logprobs before", before["logprobs"][0, 3:].tolist())
    print("logprobs after ", after["logprobs"][0, 3:].tolist())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="hf")
    main(parser.parse_args().backend)
