"""Per-sample sampling settings: the config's values, overridden by per-sample batch keys."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SampleParams:
    """Everything an engine needs to decode one sample. ``top_k`` -1 means off; greedy is
    ``temperature == 0``; ``stop_token_ids`` holds the config's stop ids and the model's EOS ids
    (an engine needs no EOS of its own)."""

    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_strings: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    seed: int | None
    #: The adapter version it decodes with (``rollgen.refit.adapters``; None: the model alone).
    adapter: int | None = None
    #: The weight version it decodes with: an engine whose prefix cache keys each prompt by it
    #: reuses no prefix computed under other weights (``EngineFacts.versioned_prefixes``).
    weight_version: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def prefix_salt(self) -> str:
        """The key an engine's prefix cache files this sample's prompt under (vLLM's
        ``cache_salt``, SGLang's ``extra_key``): one per weight version."""
        return f"rollgen-weights-{self.weight_version}"


def resolve_sampling(
    cfg: Mapping[str, Any],
    data: Mapping[str, Any],
    greedy: bool,
    max_model_len: int,
    eos_token_ids: tuple[int, ...] = (),
    adapter: int | None = None,
    weight_version: int = 0,
) -> list[SampleParams]:
    """One SampleParams per sample of ``data``. ``max_new_tokens`` is capped so that prompt plus
    generation fits in ``max_model_len``; the model's ``eos_token_ids`` join the stop ids; every
    sample decodes with ``adapter`` and ``weight_version``."""
    batch = data["input_ids"].shape[0]
    lengths = data["input_lengths"].tolist()

    def column(key: str, default: Any) -> list[Any]:
        if key in data:
            return torch.as_tensor(data[key]).tolist()
        return [default] * batch

    temps = [0.0] * batch if greedy else column("temperature", float(cfg["temperature"]))
    top_ps = column("top_p", float(cfg["top_p"]))
    top_ks = column("top_k", -1 if cfg["top_k"] is None else int(cfg["top_k"]))
    budgets = column("max_new_tokens", int(cfg["max_new_tokens"]))
    seeds = column("seed", None)
    stops = data.get("stop_strings") or [None] * batch
    base_stops = tuple(cfg.get("stop_strings") or ())
    stop_ids = tuple(dict.fromkeys(tuple(cfg.get("stop_token_ids") or ()) + eos_token_ids))
    return [
        SampleParams(
            temperature=float(temps[i]),
            top_p=1.0 if greedy else float(top_ps[i]),
            top_k=-1 if greedy else int(top_ks[i]),
            max_new_tokens=max(1, min(int(budgets[i]), max_model_len - lengths[i])),
            stop_strings=tuple(dict.fromkeys(base_stops + tuple(stops[i] or ()))),
            stop_token_ids=stop_ids,
            seed=None if seeds[i] is None else int(seeds[i]),
            adapter=adapter,
            weight_version=weight_version,
        )
        for i in range(batch)
    ]


def truncate_at_stop(text: str, stop_strings: tuple[str, ...] | list[str]) -> str:
    """Cut ``text`` right after the earliest stop string (kept, as in the token output)."""
    ends = [text.find(s) + len(s) for s in stop_strings if s in text]
    return text[: min(ends)] if ends else text


def process_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """The logits sampled from, per row of [B, V] ``logits`` ([B] settings): divided by the
    temperature (rows at 0 are left unscaled: greedy takes their argmax), then top-k (the ``k``
    highest; 0 or -1: off; of tokens tied at the k-th place, the sort's order decides), then top-p over the
    top-k distribution renormalized: the smallest set of the most likely tokens whose mass
    reaches ``p``, the token that crosses ``p`` included (the most likely token always stays).
    Dropped tokens are -inf: ``log_softmax`` of the result gives processed logprobs."""
    scaled = logits / torch.where(temperature > 0, temperature, 1.0).unsqueeze(1)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device).unsqueeze(0)
    drop = (top_k > 0).unsqueeze(1) & (ranks >= top_k.unsqueeze(1))
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    drop |= (probs.cumsum(-1) - probs) >= top_p.unsqueeze(1)
    filtered = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, filtered)
