"""The demos' trainer: a policy-gradient step with group-normalised advantages (GRPO's) on a
Hugging Face policy, and the refit that follows it, the way a trainer drives rollgen (sleep →
update → wake the weights → refit → wake the KV cache)."""

from __future__ import annotations

from typing import Any

import torch


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """Each reward less its group's mean, over the group's standard deviation (groups: runs of
    ``group`` consecutive samples of one prompt)."""
    grouped = rewards.view(-1, group)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).flatten()


def sequence_logprobs(policy: Any, ids: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The policy's logprob of every token after the first (with gradients), [B, W - 1], for
    right-padded ``ids`` whose rows end at ``ends``."""
    mask = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0) < ends.unsqueeze(1)
    logits = policy(input_ids=ids, attention_mask=mask.long()).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def policy_loss(logprobs: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """REINFORCE with each sample's advantage on its trained tokens (``mask``), averaged over them."""
    return -(advantages.unsqueeze(1) * logprobs * mask).sum() / mask.sum()


def update_and_refit(gen: Any, policy: Any, optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    """One optimizer step on ``loss`` while the engine sleeps, then the new weights refitted."""
    gen.finish_generation()  # the engine sleeps while the trainer trains
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    gen.prepare_for_generation(tags=["weights"])
    gen.refit(policy, dtype=gen.engine_dtype)
    gen.prepare_for_generation(tags=["kv_cache"])
