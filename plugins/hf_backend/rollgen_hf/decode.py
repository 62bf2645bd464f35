"""Batched incremental decoding with per-sample settings, on any HF causal LM."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollgen.sampling import SampleParams


@dataclass
class Decoded:
    tokens: torch.Tensor  # [B, G] (padded with 0 past lengths)
    logprobs: torch.Tensor  # [B, G]
    lengths: torch.Tensor  # [B]


def to_left_padded(ids: torch.Tensor, lengths: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [B, L] → (left-padded ids, attention mask), trimmed to the longest prompt."""
    width = int(lengths.max())
    shift = (width - lengths).unsqueeze(1)
    src = torch.arange(width).unsqueeze(0) - shift
    mask = src >= 0
    left = torch.where(mask, ids[:, :width].gather(1, src.clamp(min=0)), torch.full_like(src, pad))
    return left, mask.long()


def process_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Temperature, top-k and top-p per row (temperature 0 rows are left unscaled)."""
    scaled = logits / torch.where(temperature > 0, temperature, 1.0).unsqueeze(1)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device).unsqueeze(0)
    drop = (top_k > 0).unsqueeze(1) & (ranks >= top_k.unsqueeze(1))
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    drop |= (probs.cumsum(-1) - probs) >= top_p.unsqueeze(1)
    filtered = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, filtered)


def sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row from ``probs`` given one uniform per row."""
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(1))
    return idx.squeeze(1).clamp(max=probs.shape[-1] - 1)


@torch.no_grad()
def decode(
    model: Any,
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    params: Sequence[SampleParams],
    *,
    pad_token_id: int,
    processed_logprobs: bool,
    stop_hit: Callable[[int, list[int]], bool],
    generator: torch.Generator | None,
) -> Decoded:
    """Decode every row until a stop token id (the model's EOS ids among them), a stop string or
    its token budget."""
    device = next(model.parameters()).device
    batch = input_ids.shape[0]
    temperature = torch.tensor([p.temperature for p in params], device=device)
    top_k = torch.tensor([p.top_k for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    budget = torch.tensor([p.max_new_tokens for p in params])
    greedy = temperature == 0
    stop_sets = [p.stop_token_ids for p in params]  # the core's: unique already
    stop_table = torch.full((batch, max(1, max(len(x) for x in stop_sets))), -1, dtype=torch.long)
    for i, ids_i in enumerate(stop_sets):
        stop_table[i, : len(ids_i)] = torch.tensor(ids_i, dtype=torch.long)
    has_stop_strings = [i for i, p in enumerate(params) if p.stop_strings]
    row_gens = {i: torch.Generator().manual_seed(p.seed) for i, p in enumerate(params) if p.seed is not None}

    ids, mask = to_left_padded(input_ids, input_lengths, pad_token_id)
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1].float()
    next_pos = positions[:, -1:] + 1

    steps = int(budget.max())
    tokens = torch.zeros((batch, steps), dtype=torch.long)
    logprobs = torch.zeros((batch, steps), dtype=torch.float32)
    lengths = torch.zeros(batch, dtype=torch.long)
    done = torch.zeros(batch, dtype=torch.bool)
    for step in range(steps):
        raw = logits.log_softmax(-1)
        processed = process_logits(logits, temperature, top_k, top_p).log_softmax(-1)
        uniforms = torch.rand(batch, generator=generator)
        for i, g in row_gens.items():
            uniforms[i] = torch.rand(1, generator=g)[0]
        sampled = sample(processed.exp().cpu(), uniforms).to(device)
        chosen = torch.where(greedy, logits.argmax(-1), sampled)
        lp = (processed if processed_logprobs else raw).gather(1, chosen.unsqueeze(1)).squeeze(1)
        active = ~done
        chosen_cpu = chosen.cpu()
        tokens[active, step] = chosen_cpu[active]
        logprobs[active, step] = lp.cpu()[active]
        lengths += active.long()
        hit_stop_id = (stop_table == chosen_cpu.unsqueeze(1)).any(dim=1)
        done |= active & (hit_stop_id | (lengths >= budget))
        for i in has_stop_strings:
            if active[i] and not done[i] and stop_hit(i, tokens[i, : lengths[i]].tolist()):
                done[i] = True
        if done.all():
            break
        feed = torch.where(done.to(device), torch.full_like(chosen, pad_token_id), chosen)
        mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=device)], dim=1)
        out = model(
            input_ids=feed.unsqueeze(1),
            attention_mask=mask,
            position_ids=next_pos,
            past_key_values=past,
            use_cache=True,
        )
        past, logits = out.past_key_values, out.logits[:, -1].float()
        next_pos = next_pos + 1
    return Decoded(tokens, logprobs, lengths)
