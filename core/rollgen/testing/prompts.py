"""The prompts the conformance suite, the demo and the tests share, and how they are encoded and
decoded (right-padded token ids in, generated text out)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rollgen.data import right_pad

PROMPTS = [
    "count: 3 4 5",
    "abc: c d",
    "count: 17 18 19 20 21 22",
    "abc: a b c d e f g",
    "count: 40",
]


def encode(tokenizer: Any, prompts: list[str], extra_pad: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded batch of ``prompts``."""
    enc = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    ids, lengths = right_pad(enc, tokenizer.pad_token_id, torch.long)
    pad = torch.full((len(enc), extra_pad), tokenizer.pad_token_id, dtype=torch.long)
    return {"input_ids": torch.cat([ids, pad], dim=1), "input_lengths": lengths}


def generated_texts(
    tokenizer: Any,
    out: Mapping[str, torch.Tensor],
    batch: Mapping[str, torch.Tensor],
    skip_special: bool = False,
) -> list[str]:
    rows = out["output_ids"].tolist()
    return [
        tokenizer.decode(r[s:e], skip_special_tokens=skip_special)
        for r, s, e in zip(rows, batch["input_lengths"].tolist(), out["unpadded_sequence_lengths"].tolist())
    ]
