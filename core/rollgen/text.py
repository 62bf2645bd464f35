"""The text path of ``generate_text``: prompts to a batch, the batch's output back to texts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rollgen.data import BatchedDataDict, right_pad
from rollgen.errors import InputError
from rollgen.sampling import truncate_at_stop


def hits_stop_string(tokenizer: Any, stop_strings: Sequence[str], tokens: list[int]) -> bool:
    """Whether ``tokens`` (a sample's generated tokens) hold one of ``stop_strings``: the one rule
    for every backend, the text as ``generate_text`` returns it (special tokens skipped)."""
    return any(s in tokenizer.decode(tokens, skip_special_tokens=True) for s in stop_strings)


def prompt_batch(tokenizer: Any, data: Any, pad_token_id: int) -> dict[str, Any] | None:
    """The batch of ``{"prompts": [str, ...], "stop_strings": ...}`` (encoded without special
    tokens, right-padded); None for no prompts. InputError for anything else, or a prompt that
    encodes to no tokens."""
    prompts = data.get("prompts") if isinstance(data, Mapping) else None
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise InputError('generate_text takes {"prompts": [str, ...]}')
    if not prompts:
        return None
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    empty = [i for i, e in enumerate(encoded) if not e]
    if empty:
        raise InputError(f"sample(s) {empty}: prompt encodes to no tokens", empty)
    ids, lengths = right_pad(encoded, pad_token_id, torch.long)
    batch: dict[str, Any] = {"input_ids": ids, "input_lengths": lengths}
    if data.get("stop_strings") is not None:
        batch["stop_strings"] = data["stop_strings"]
    return batch


def texts(
    tokenizer: Any, batch: Mapping[str, Any], out: BatchedDataDict[Any], stop_strings: Sequence[str]
) -> list[str]:
    """Each sample's generated text (special tokens skipped), cut before the first stop string
    it holds (``stop_strings``, the config's, and the sample's own)."""
    starts, ends = batch["input_lengths"].tolist(), out["unpadded_sequence_lengths"].tolist()
    rows = out["output_ids"].tolist()
    generated = [r[s:e] for r, s, e in zip(rows, starts, ends)]
    decoded = tokenizer.batch_decode(generated, skip_special_tokens=True)
    stops = batch.get("stop_strings") or [None] * len(decoded)
    return [truncate_at_stop(t, tuple(stop_strings) + tuple(s or ())) for t, s in zip(decoded, stops)]
