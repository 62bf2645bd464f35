"""Batched incremental decoding with per-sample settings, on any HF causal LM."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollgen.rollout import SampleRequest
from rollgen.sampling import SampleParams, process_logits
from rollgen.streaming_loop import StepOutput


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


def sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row from ``probs`` given one uniform per row."""
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(1))
    return idx.squeeze(1).clamp(max=probs.shape[-1] - 1)


class Decoder:
    """Batched incremental decoding of one batch with per-sample settings, one token per
    ``step()``: every row runs until a stop token id (the model's EOS ids among them), a stop
    string or its token budget, or until ``stop`` ends it."""

    @torch.no_grad()
    def __init__(
        self,
        model: Any,
        input_ids: torch.Tensor,
        input_lengths: torch.Tensor,
        params: Sequence[SampleParams],
        *,
        pad_token_id: int,
        processed_logprobs: bool,
        stop_hit: Callable[[int, list[int]], bool],
        generator: torch.Generator | None,
    ) -> None:
        self.model, self.pad_token_id, self.processed_logprobs = model, pad_token_id, processed_logprobs
        self.stop_hit, self.generator = stop_hit, generator
        device = self.device = next(model.parameters()).device
        batch = self.batch = input_ids.shape[0]
        self.temperature = torch.tensor([p.temperature for p in params], device=device)
        self.top_k = torch.tensor([p.top_k for p in params], device=device)
        self.top_p = torch.tensor([p.top_p for p in params], device=device)
        self.budget = torch.tensor([p.max_new_tokens for p in params])
        stop_sets = [p.stop_token_ids for p in params]  # the core's: unique already
        self.stop_table = torch.full((batch, max(1, max(len(x) for x in stop_sets))), -1, dtype=torch.long)
        for i, ids_i in enumerate(stop_sets):
            self.stop_table[i, : len(ids_i)] = torch.tensor(ids_i, dtype=torch.long)
        self.has_stop_strings = [i for i, p in enumerate(params) if p.stop_strings]
        self.row_gens = {
            i: torch.Generator().manual_seed(p.seed) for i, p in enumerate(params) if p.seed is not None
        }
        ids, mask = to_left_padded(input_ids, input_lengths, pad_token_id)
        self.mask = mask.to(device)
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        out = model(
            input_ids=ids.to(device), attention_mask=self.mask, position_ids=positions, use_cache=True
        )
        self.past, self.logits = out.past_key_values, out.logits[:, -1].float()
        self.next_pos = positions[:, -1:] + 1
        steps = int(self.budget.max())
        self.tokens = torch.zeros((batch, steps), dtype=torch.long)
        self.logprobs = torch.zeros((batch, steps), dtype=torch.float32)
        self.lengths = torch.zeros(batch, dtype=torch.long)
        self.done = torch.zeros(batch, dtype=torch.bool)
        self.step_index = 0

    @property
    def finished(self) -> bool:
        return bool(self.done.all())

    def stop(self, rows: Sequence[int]) -> None:
        """End ``rows`` where they are."""
        self.done[list(rows)] = True

    def row(self, i: int) -> tuple[list[int], list[float]]:
        """Row ``i``'s generated tokens and their logprobs so far."""
        n = int(self.lengths[i])
        return self.tokens[i, :n].tolist(), self.logprobs[i, :n].tolist()

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits each row samples from (``rollgen.sampling.process_logits``)."""
        return process_logits(logits, self.temperature, self.top_k, self.top_p)

    def run(self) -> Decoded:
        """Decode every row to its end."""
        while not self.finished:
            self.step()
        return Decoded(self.tokens, self.logprobs, self.lengths)

    @torch.no_grad()
    def step(self) -> list[int]:
        """Choose one token for every running row; returns the rows that ended with it."""
        logits, step, batch, device = self.logits, self.step_index, self.batch, self.device
        raw = logits.log_softmax(-1)
        processed = self.process(logits).log_softmax(-1)
        uniforms = torch.rand(batch, generator=self.generator)
        for i, g in self.row_gens.items():
            uniforms[i] = torch.rand(1, generator=g)[0]
        sampled = sample(processed.exp().cpu(), uniforms).to(device)
        chosen = torch.where(self.temperature == 0, logits.argmax(-1), sampled)
        lp = (processed if self.processed_logprobs else raw).gather(1, chosen.unsqueeze(1)).squeeze(1)
        active = ~self.done
        chosen_cpu = chosen.cpu()
        self.tokens[active, step] = chosen_cpu[active]
        self.logprobs[active, step] = lp.cpu()[active]
        self.lengths += active.long()
        hit_stop_id = (self.stop_table == chosen_cpu.unsqueeze(1)).any(dim=1)
        self.done |= active & (hit_stop_id | (self.lengths >= self.budget))
        for i in self.has_stop_strings:
            if (
                active[i]
                and not self.done[i]
                and self.stop_hit(i, self.tokens[i, : self.lengths[i]].tolist())
            ):
                self.done[i] = True
        self.step_index += 1
        if not self.finished:
            feed = torch.where(self.done.to(device), torch.full_like(chosen, self.pad_token_id), chosen)
            self.mask = torch.cat(
                [self.mask, torch.ones((batch, 1), dtype=self.mask.dtype, device=device)], dim=1
            )
            out = self.model(
                input_ids=feed.unsqueeze(1),
                attention_mask=self.mask,
                position_ids=self.next_pos,
                past_key_values=self.past,
                use_cache=True,
            )
            self.past, self.logits = out.past_key_values, out.logits[:, -1].float()
            self.next_pos = self.next_pos + 1
        return (active & self.done).nonzero().flatten().tolist()


class Cohorts:
    """The streamed samples being decoded: one ``Decoder`` per request list (``decoder``
    builds it, prefilling), each stepped in turn; the hooks of a ``rollgen.streaming_loop``
    ``StepLoop``."""

    def __init__(self, decoder: Callable[[list[SampleRequest]], Decoder]) -> None:
        self._decoder = decoder
        self._cohorts: list[tuple[Decoder, list[str]]] = []

    def add(self, requests: list[SampleRequest]) -> None:
        """One decoder per adapter version among ``requests``: a decoder steps its finished rows
        until all end, and a version no running sample uses may be dropped meanwhile."""
        for version in dict.fromkeys(r.params.adapter for r in requests):
            cohort = [r for r in requests if r.params.adapter == version]
            self._cohorts.append((self._decoder(cohort), [r.key for r in cohort]))

    def abort(self, keys: list[str]) -> None:
        wanted = set(keys)
        for decoder, cohort in self._cohorts:
            decoder.stop([i for i, k in enumerate(cohort) if k in wanted])
        self._drop_finished()

    def step(self) -> list[StepOutput]:
        """A step of every cohort: each moved row's new token and logprob, and whether it ended."""
        moved: list[StepOutput] = []
        for decoder, keys in self._cohorts:
            before = decoder.lengths.clone()
            ended = set(decoder.step())
            rows = (decoder.lengths > before).nonzero().flatten()
            at = decoder.lengths[rows] - 1
            tokens, logprobs = decoder.tokens[rows, at].tolist(), decoder.logprobs[rows, at].tolist()
            moved += [(keys[i], [t], [lp], i in ended) for i, t, lp in zip(rows.tolist(), tokens, logprobs)]
        self._drop_finished()
        return moved

    def _drop_finished(self) -> None:
        self._cohorts = [(d, k) for d, k in self._cohorts if not d.finished]
