"""The trainer's view: an independent HF transformers pass that scores generated sequences."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rollgen.refit.adapters import AdapterSpec, merged


def load_reference_model(model_dir: str, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.eval()


@torch.no_grad()
def perturbed_model(model_dir: str, seed: int, scale: float = 0.2) -> Any:
    """The reference model with seeded Gaussian noise of ``scale`` added to every parameter:
    weights a refit can tell apart from the served ones."""
    policy = load_reference_model(model_dir)
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=noise) * scale)
    return policy


@torch.no_grad()
def one_token_model(model_dir: str, token: int) -> Any:
    """The reference model rewired to emit ``token`` after any prefix, by a wide margin: every
    embedding is the first unit vector, the attention and MLP outputs are zero (the residual
    stream stays that vector), and only ``token``'s output row reads it. Greedy samples under
    these weights never stop early: each runs to its budget, all ``token``. For Llama-style
    models (Qwen2, Llama, Mistral: ``model.embed_tokens``, ``o_proj``, ``down_proj``,
    ``model.norm``, an untied ``lm_head``)."""
    policy = load_reference_model(model_dir)
    inner = policy.model
    inner.embed_tokens.weight.zero_()[:, 0] = 1.0
    for layer in inner.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    inner.norm.weight.fill_(1.0)
    policy.lm_head.weight.zero_()[token, 0] = 1.0
    return policy


def next_token_logprobs(
    model: Any, output_ids: torch.Tensor, unpadded_sequence_lengths: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``model``'s log-softmax over the vocabulary for the token after each position but the
    last, [B, W - 1, V] (one forward pass, on the model's device)."""
    device = next(model.parameters()).device
    positions = torch.arange(output_ids.shape[1], device=device).unsqueeze(0)
    mask = positions < unpadded_sequence_lengths.to(device).unsqueeze(1)
    ids = output_ids.clamp(min=0, max=model.config.vocab_size - 1).to(device)
    logits = model(input_ids=ids, attention_mask=mask.long()).logits.float()
    return torch.log_softmax(logits[:, :-1] / temperature, dim=-1)


def scored_logprobs(
    logp: torch.Tensor,
    output_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    unpadded_sequence_lengths: torch.Tensor,
) -> torch.Tensor:
    """The logprob ``logp`` (from ``next_token_logprobs``) gives each generated token, in the
    GenerationOutputSpec layout: 0 on prompt and padding positions (on the CPU)."""
    batch, width = output_ids.shape
    ids = output_ids.clamp(min=0, max=logp.shape[-1] - 1).to(logp.device)
    out = torch.zeros((batch, width), dtype=torch.float32)
    out[:, 1:] = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1).float().cpu()
    positions = torch.arange(width).unsqueeze(0)
    generated = (positions >= input_lengths.unsqueeze(1)) & (
        positions < unpadded_sequence_lengths.unsqueeze(1)
    )
    return out * generated


def teacher_forced_logprobs(
    model: Any,
    output_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    unpadded_sequence_lengths: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Logprob of every generated token under ``model`` (as a trainer recomputes them), in the
    GenerationOutputSpec layout: 0 on prompt and padding positions."""
    logp = next_token_logprobs(model, output_ids, unpadded_sequence_lengths, temperature)
    return scored_logprobs(logp, output_ids, input_lengths, unpadded_sequence_lengths)


def agreement(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """max |Δlogp|, mean |Δlogp| and NeMo-RL's token_mult_prob_error (mean exp|Δlogp|)."""
    diff = (a.float() - b.float()).abs()[mask]
    if diff.numel() == 0:
        return {"max_abs": 0.0, "mean_abs": 0.0, "token_mult_prob_error": 1.0, "tokens": 0}
    return {
        "max_abs": float(diff.max()),
        "mean_abs": float(diff.mean()),
        "token_mult_prob_error": float(diff.exp().mean()),
        "tokens": int(diff.numel()),
    }


@torch.no_grad()
def versioned_logprob_error(
    token_ids: list[int],
    logprobs: list[float | None],
    spans: list[dict[str, int]],
    models: dict[int, Any],
) -> float:
    """The largest |Δlogp| between an engine's logprobs of a token sequence and teacher-forced
    ones, each generated token scored by the model of its weight version (``spans``:
    ``{version, start, end}`` positions in ``token_ids``, as rollgen serve's sessions and
    choices give them; ``logprobs`` indexed like ``token_ids``)."""
    ids = torch.tensor([token_ids])
    whole = torch.tensor([len(token_ids)])
    worst = 0.0
    for version in {s["version"] for s in spans}:
        ref = teacher_forced_logprobs(models[version], ids, torch.tensor([0]), whole)[0]
        for span in (s for s in spans if s["version"] == version):
            for i in range(span["start"], span["end"]):
                engine = logprobs[i]
                if engine is None:
                    raise ValueError(f"position {i} is in a version span but has no logprob")
                worst = max(worst, abs(float(ref[i]) - engine))
    return worst


def processed_logprobs(
    logp: torch.Tensor, top_k: int, top_p: float, margin: float = 1e-4
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's processed distribution, written apart from the engines' (in float64):
    ``logp`` [..., V] the tempered log-softmax (``next_token_logprobs(..., temperature)``), then
    top-k (the ``top_k`` most likely; -1: off), then top-p over the top-k distribution
    renormalized (the smallest set of the most likely tokens whose mass reaches ``top_p``, the
    crossing token included), renormalized: log-probs, -inf where dropped. Also a mask of the rows
    whose outcome rounding could change: a top-k cut between logprobs within ``margin``, or a
    top-p threshold within ``margin`` of a set's mass."""
    logp = logp.double()
    vocab = logp.shape[-1]
    ordered, order = logp.sort(dim=-1, descending=True)
    keep = torch.ones_like(ordered, dtype=torch.bool)
    near = torch.zeros(logp.shape[:-1], dtype=torch.bool)
    if 0 < top_k < vocab:
        keep[..., top_k:] = False
        near |= (ordered[..., top_k - 1] - ordered[..., top_k]).abs() < margin
    probs = ordered.exp() * keep
    probs = probs / probs.sum(-1, keepdim=True)
    before = probs.cumsum(-1) - probs  # mass of the tokens ahead of each
    if top_p < 1.0:
        keep &= before < top_p
        keep[..., 0] = True
        near |= ((before - top_p).abs() < margin).any(-1)
    kept = ordered.masked_fill(~keep, float("-inf"))
    kept = kept - kept.logsumexp(-1, keepdim=True)
    return torch.empty_like(kept).scatter_(-1, order, kept), near


def random_adapter(spec: AdapterSpec, seed: int, scale: float = 0.03) -> dict[str, torch.Tensor]:
    """A LoRA adapter of ``spec`` (PEFT's names and shapes, its dtype) with seeded Gaussian
    factors of ``scale``: outputs a refit can tell apart from the model's alone. The default
    gives the tiny model's layers an update of about a tenth of their weights, as a trained
    adapter's is; one as large as the weights themselves (scale 0.3) makes bf16 rounding alone
    (the merged reference's against an engine's unmerged LoRA) move greedy tokens."""
    noise = torch.Generator().manual_seed(seed)
    return {
        name: (torch.randn(shape, generator=noise) * scale).to(getattr(torch, dtype))
        for name, (shape, dtype) in spec.weights.items()
    }


def merged_reference(
    model_dir: str, adapter: Mapping[str, torch.Tensor], spec: AdapterSpec, dtype: torch.dtype = torch.float32
) -> Any:
    """The reference model with ``adapter`` merged into its weights (``W + scaling·B·A``, in
    fp32), in ``dtype``."""
    policy = load_reference_model(model_dir)
    policy.load_state_dict(merged(policy.state_dict(), list(adapter.items()), spec))
    return policy.to(dtype)
