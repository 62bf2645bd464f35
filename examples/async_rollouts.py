"""Asynchronous rollouts: the trainer keeps batches in flight with ``gen.submit``, takes each
group of ``--group`` samples of one prompt as the whole group finishes (``rollout.groups``, so a
GRPO group is never split and short samples are not favoured), trains on every ``--step``
finished samples and refits while the other samples run (``mode="keep"``: they continue on the
new weights, and every token says which weights made it). Each result names its rollout (the
``tag`` given to ``submit``), as several rollouts feed one queue.

    python examples/async_rollouts.py [--backend hf|vllm] [--samples 24] [--step 8] [--group 2]
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

#: Rows per submitted batch (whole groups).
BATCH_ROWS = 4


async def main(backend: str, samples: int, step: int, group: int) -> None:
    model_dir = tiny_model_dir()
    trainer = load_reference_model(model_dir)  # the policy being trained
    if BATCH_ROWS % group or samples % BATCH_ROWS or step % group:
        raise SystemExit(f"--group must divide {BATCH_ROWS} and --step; --samples a multiple of {BATCH_ROWS}")
    prompts = torch.randint(10, 200, (samples // group, 6), generator=torch.Generator().manual_seed(0))
    rows = prompts.repeat_interleave(group, dim=0)  # each prompt `group` times, side by side
    batches = [
        {"input_ids": rows[i : i + BATCH_ROWS], "input_lengths": torch.full((BATCH_ROWS,), 6)}
        for i in range(0, samples, BATCH_ROWS)
    ]
    config = tiny_config(backend, model_dir, max_new_tokens=32, temperature=1.0, seed=0)
    finished: list[rollgen.SampleResult] = []
    with rollgen.create_generation(config) as gen:
        queue: asyncio.Queue[list[rollgen.SampleResult]] = asyncio.Queue()

        async def take(rollout: rollgen.Rollout) -> None:
            async for whole in rollout.groups(group):  # a group once all its samples finished
                await queue.put(whole)

        tasks = [asyncio.create_task(take(gen.submit(b, tag=f"batch {i}"))) for i, b in enumerate(batches)]
        trained = 0
        while len(finished) < samples:
            finished.extend(await queue.get())
            if len(finished) - trained >= step and len(finished) < samples:
                trained = len(finished)
                with torch.no_grad():  # a stand-in for a training step on the finished groups
                    for p in trainer.parameters():
                        p.mul_(1.01)
                await asyncio.to_thread(gen.refit, trainer, dtype=gen.engine_dtype, mode="keep")
                print(f"refit to weight version {gen.weight_version} after {len(finished)} samples")
        await asyncio.gather(*tasks)
    versions = Counter(len(r.versions) for r in finished)
    print(f"samples {len(finished)}, stop reasons {dict(Counter(r.stop_reason for r in finished))}")
    print(f"samples made under one weight version: {versions[1]}, under several: {samples - versions[1]}")
    for r in finished[:4]:
        print(f"{r.tag} sample {r.index}: {len(r.token_ids)} tokens, versions {list(r.versions)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="hf")
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--step", type=int, default=8)
    parser.add_argument("--group", type=int, default=2)
    args = parser.parse_args()
    asyncio.run(main(args.backend, args.samples, args.step, args.group))
