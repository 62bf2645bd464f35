"""The demo: a few steps of RL on the tiny model, the way a trainer drives rollgen.

Each step generates a group of samples per prompt, scores them (the reward: how many items the
sample adds to the prompt's run, correctly, e.g. ``count: 3 4 5`` → `` 6 7 8``, up to ``TARGET``),
takes one policy-gradient step with group-normalised advantages (GRPO's), and pushes the new
weights into the engine (sleep → wake the weights → refit → wake the KV cache). The engine's
logprobs are compared with the trainer's own for the same tokens and weights, and the reward
should rise from step to step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

import rollgen
from rollgen.output import generated_mask
from rollgen.testing.grpo import group_advantages, policy_loss, sequence_logprobs, update_and_refit
from rollgen.testing.prompts import PROMPTS, encode, generated_texts
from rollgen.testing.reference import agreement, load_reference_model

#: Items a sample may add for the full reward.
TARGET = 6
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def reward(prompt: str, continuation: str) -> float:
    """The share of ``TARGET`` items that ``continuation`` adds correctly to the run of numbers
    or letters in ``prompt`` (counting stops at the first wrong item)."""
    kind, _, items = prompt.partition(": ")
    last = items.split()[-1]
    if kind == "count":
        expected = [str(int(last) + k) for k in range(1, TARGET + 1)]
    else:
        start = LETTERS.index(last) + 1
        expected = list(LETTERS[start : start + TARGET])
    correct = 0
    for got, want in zip(continuation.split(), expected):
        if got != want:
            break
        correct += 1
    return correct / TARGET


@dataclass(frozen=True)
class DemoSettings:
    steps: int = 8
    group: int = 8
    learning_rate: float = 2e-3


def rl_step(
    gen: Any,
    policy: Any,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    prompts: list[str],
    group: int,
) -> dict[str, float]:
    """One step: generate, reward, check the engine's logprobs, update the policy, refit."""
    out = gen.generate(batch)
    texts = generated_texts(gen.tokenizer, out, batch, skip_special=True)
    rewards = torch.tensor([reward(p, t) for p, t in zip(prompts, texts)])
    lengths = out["generation_lengths"].float()
    mask = generated_mask(out, batch["input_lengths"])[:, 1:]
    logp = sequence_logprobs(policy, out["output_ids"], out["unpadded_sequence_lengths"])
    stats = agreement(out["logprobs"][:, 1:], logp.detach(), mask)
    update_and_refit(gen, policy, optimizer, policy_loss(logp, mask, group_advantages(rewards, group)))
    return {
        "reward": float(rewards.mean()),
        "length": float(lengths.mean()),
        "eos": sum(r == "eos" for r in out["stop_reasons"]) / len(out["stop_reasons"]),
        "max_abs_dlogp": stats["max_abs"],
    }


def run_demo(
    backend: str, cfg: dict[str, Any], console: Console, settings: DemoSettings | None = None
) -> list[dict[str, float]]:
    """A few RL steps on the tiny model through ``backend``, shown as a table; each step's
    measures."""
    settings = settings or DemoSettings()
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(cfg["model_name"])
    prompts = [p for p in PROMPTS for _ in range(settings.group)]
    batch = encode(tokenizer, prompts)
    policy = load_reference_model(cfg["model_name"]).train()
    optimizer = torch.optim.Adam(policy.parameters(), lr=settings.learning_rate)
    table = Table(title=f"rollgen demo: RL on the tiny model through backend {backend!r}")
    for column in ("step", "mean reward", "mean length", "ended by EOS", "max |Δlogp| engine vs trainer"):
        table.add_column(column, justify="right")
    with rollgen.create_generation({**cfg, "dtype": "float32"}) as gen:
        rows = []
        for step in tqdm(range(settings.steps), desc="RL steps", unit="step"):
            row = rl_step(gen, policy, optimizer, batch, prompts, settings.group)
            rows.append(row)
            table.add_row(
                str(step),
                f"{row['reward']:.3f}",
                f"{row['length']:.1f}",
                f"{row['eos']:.0%}",
                f"{row['max_abs_dlogp']:.1e}",
            )
    console.print(table)
    console.print(
        f"reward (items the sample adds to the prompt's run correctly, of {TARGET}): "
        f"[bold]{rows[0]['reward']:.3f} → {rows[-1]['reward']:.3f}[/] over {settings.steps} steps of "
        f"{len(PROMPTS)} prompts × {settings.group} samples; the engine's logprobs matched the "
        f"trainer's to within {max(r['max_abs_dlogp'] for r in rows):.1e}"
    )
    return rows
