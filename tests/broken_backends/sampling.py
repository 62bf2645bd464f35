"""Broken copies of the hf backend that break a sampling or logprob rule (each named in its
docstring); stand-ins for the suite's mutation test."""

from __future__ import annotations

from typing import Any

import torch

from rollgen_hf.decode import Decoder
from rollgen_hf.generation import HfGeneration


def cut(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    keep_crossing: bool = True,
    extra_k: int = 0,
    top_p_first: bool = False,
) -> torch.Tensor:
    """``rollgen.sampling.process_logits`` with one of its rules bent: the token that crosses
    top-p dropped, ``extra_k`` more tokens kept by top-k, or top-p over the whole tempered
    distribution before top-k."""
    scaled = logits / torch.where(temperature > 0, temperature, 1.0).unsqueeze(1)
    ordered, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[-1]).unsqueeze(0)
    by_k = (top_k > 0).unsqueeze(1) & (ranks >= (top_k + extra_k).unsqueeze(1))
    probs = ordered.masked_fill(torch.zeros_like(by_k) if top_p_first else by_k, float("-inf")).softmax(-1)
    ahead = probs.cumsum(-1) if not keep_crossing else probs.cumsum(-1) - probs
    by_p = ahead >= top_p.unsqueeze(1)
    by_p[:, 0] = False
    kept = ordered.masked_fill(by_k | by_p, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, kept)


class SharedBatchGenerator(HfGeneration):
    """Breaks the seed rule: one generator, seeded with the batch's first seed, draws for every
    seeded sample of the batch (so a sample depends on the others)."""

    class decoder_cls(Decoder):  # noqa: N801 - the hook's name
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.row_gens:
                first = min(self.row_gens)
                self.row_gens = dict.fromkeys(self.row_gens, self.row_gens[first])


class ProcessedWhenRawAsked(HfGeneration):
    """Breaks the logprob rule: processed logprobs (after temperature, top-k, top-p) where raw
    ones (the default) were asked for."""

    class decoder_cls(Decoder):  # noqa: N801
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.processed_logprobs = True


class RawWhenProcessedAsked(HfGeneration):
    """Breaks ``logprobs_mode="processed"``: raw logprobs returned."""

    class decoder_cls(Decoder):  # noqa: N801
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.processed_logprobs = False


class CutsIgnored(HfGeneration):
    """Breaks top-k and top-p: samples (and scores processed logprobs) from the tempered
    distribution alone."""

    class decoder_cls(Decoder):  # noqa: N801
        def process(self, logits: torch.Tensor) -> torch.Tensor:
            return logits / torch.where(self.temperature > 0, self.temperature, 1.0).unsqueeze(1)


class TopPDropsCrossingToken(HfGeneration):
    """Breaks top-p: keeps only the tokens whose mass together stays below top-p, dropping the
    token that crosses it."""

    class decoder_cls(Decoder):  # noqa: N801
        def process(self, logits: torch.Tensor) -> torch.Tensor:
            return cut(logits, self.temperature, self.top_k, self.top_p, keep_crossing=False)


class TopKOffByOne(HfGeneration):
    """Breaks top-k: keeps k + 1 tokens."""

    class decoder_cls(Decoder):  # noqa: N801
        def process(self, logits: torch.Tensor) -> torch.Tensor:
            return cut(logits, self.temperature, self.top_k, self.top_p, extra_k=1)


class TopPBeforeTopK(HfGeneration):
    """Breaks the order of the cuts: top-p over the whole tempered distribution, then top-k."""

    class decoder_cls(Decoder):  # noqa: N801
        def process(self, logits: torch.Tensor) -> torch.Tensor:
            return cut(logits, self.temperature, self.top_k, self.top_p, top_p_first=True)


class StopStringsIgnored(HfGeneration):
    """Breaks stop strings: declares them, never stops at one."""

    def _stop_hit(self, params: Any) -> Any:
        return lambda row, tokens: False
