"""The demo: the RL loop's generation half on the tiny model, shown as tables."""

from __future__ import annotations

from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

import rollgen
from rollgen.output import generated_mask
from rollgen.testing.prompts import PROMPTS, encode, generated_texts
from rollgen.testing.reference import agreement, load_reference_model, teacher_forced_logprobs
from rollgen.testing.tiny_model import tiny_model_dir


def run_demo(backend: str, cfg: dict[str, Any], console: Console) -> None:
    """Generate, refit with changed weights, generate again; check logprobs against HF."""
    steps = tqdm(total=5, desc="demo", unit="step")
    steps.set_postfix_str("building the tiny models")
    trained_dir, other_dir = cfg["model_name"], tiny_model_dir(trained=False)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(trained_dir)
    batch = encode(tok, PROMPTS)
    steps.update()
    steps.set_postfix_str(f"starting {backend}")
    with rollgen.create_generation(cfg) as gen:
        steps.update()
        steps.set_postfix_str("generate (trained weights)")
        before = gen.generate(batch, greedy=True)
        steps.update()
        steps.set_postfix_str("refit (untrained weights)")
        new_model = load_reference_model(other_dir)
        gen.refit(new_model, dtype=gen.engine_dtype)
        steps.update()
        steps.set_postfix_str("generate (new weights)")
        after = gen.generate(batch, greedy=True)
        steps.update()
    steps.close()

    table = Table(title=f"rollgen demo: backend {backend!r}, greedy, {cfg['max_new_tokens']} new tokens")
    table.add_column("prompt")
    table.add_column("before refit")
    table.add_column("after refit")
    for p, a, b in zip(PROMPTS, generated_texts(tok, before, batch), generated_texts(tok, after, batch)):
        table.add_row(p, repr(a), repr(b))
    console.print(table)

    ref = teacher_forced_logprobs(
        new_model, after["output_ids"], batch["input_lengths"], after["unpadded_sequence_lengths"]
    )
    stats = agreement(after["logprobs"], ref, generated_mask(after, batch["input_lengths"]))
    summary = Table(title="logprobs after refit vs an independent HF teacher-forced pass")
    for k in stats:
        summary.add_column(k)
    summary.add_row(*(f"{v:.3g}" if isinstance(v, float) else str(v) for v in stats.values()))
    console.print(summary)
    changed = not torch.equal(before["output_ids"], after["output_ids"])
    console.print(f"outputs changed by the refit: [bold]{changed}[/]")
