"""Asynchronous rollouts: the trainer keeps batches in flight with ``gen.submit``, takes each
sample as it finishes (``async for``), trains on every ``--step`` finished samples and refits
while the other samples run (``mode="keep"``: they continue on the new weights, and every token
says which weights made it).

    python examples/async_rollouts.py [--backend hf|vllm] [--samples 24] [--step 8]
"""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter

import torch

import rollgen
from rollgen.testing import load_reference_model
from rollgen.testing.config import tiny_config
from rollgen.testing.tiny_model import tiny_model_dir


async def main(backend: str, samples: int, step: int) -> None:
    model_dir = tiny_model_dir()
    trainer = load_reference_model(model_dir)  # the policy being trained
    prompts = torch.randint(10, 200, (samples, 6), generator=torch.Generator().manual_seed(0))
    batches = [
        {"input_ids": prompts[i : i + 4], "input_lengths": torch.full((len(prompts[i : i + 4]),), 6)}
        for i in range(0, samples, 4)
    ]
    config = tiny_config(backend, model_dir, max_new_tokens=32, temperature=1.0, seed=0)
    finished: list[rollgen.SampleResult] = []
    with rollgen.create_generation(config) as gen:
        queue: asyncio.Queue[rollgen.SampleResult] = asyncio.Queue()

        async def take(rollout: rollgen.Rollout) -> None:
            async for result in rollout:
                await queue.put(result)

        tasks = [asyncio.create_task(take(gen.submit(b))) for b in batches]  # all in flight
        while len(finished) < samples:
            finished.append(await queue.get())
            if len(finished) % step == 0 and len(finished) < samples:
                with torch.no_grad():  # a stand-in for a training step on the finished samples
                    for p in trainer.parameters():
                        p.mul_(1.01)
                await asyncio.to_thread(gen.refit, trainer, dtype=gen.engine_dtype, mode="keep")
                print(f"refit to weight version {gen.weight_version} after {len(finished)} samples")
        await asyncio.gather(*tasks)
    versions = Counter(len(r.versions) for r in finished)
    print(f"samples {len(finished)}, stop reasons {dict(Counter(r.stop_reason for r in finished))}")
    print(f"samples made under one weight version: {versions[1]}, under several: {samples - versions[1]}")
    for r in finished[:4]:
        print(f"sample {r.index}: {len(r.token_ids)} tokens, versions {list(r.versions)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="hf")
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--step", type=int, default=8)
    args = parser.parse_args()
    asyncio.run(main(args.backend, args.samples, args.step))
