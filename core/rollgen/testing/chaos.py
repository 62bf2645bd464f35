"""Chaos rounds for a fleet of two replicas with ``engine_failures: "replace"``, shared by the
fleet tests and ``benchmarks.chaos``: a ``Workload`` (a batch, two perturbed copies of the model
and each one's fault-free greedy output) and ``run_round``, one round of a training-style loop
(refit, a kill landing in a call, the call's checks: a greedy ``generate``, a streamed rollout,
or a streamed rollout with a ``keep`` update in flight)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rollgen.rollout import SampleResult
from rollgen.testing.prompts import PROMPTS, encode
from rollgen.testing.reference import perturbed_model

#: A round's call, by round number modulo 3.
MODES = ("generate", "stream", "stream_keep")

#: Starts a round's kill of replica ``victim`` of the generation, before the call it must land
#: in; returns what the caller times it by (None: nothing).
Killer = Callable[[Any, int, random.Random], Any]


@dataclass
class Workload:
    """The batch, the two weights the loop alternates between, and each one's fault-free
    greedy output."""

    batch: dict[str, torch.Tensor]
    weights: list[torch.nn.Module]
    clean: list[dict[str, torch.Tensor]]

    @classmethod
    def make(cls, gen: Any, model_dir: str) -> Workload:
        from transformers import AutoTokenizer

        batch = encode(AutoTokenizer.from_pretrained(model_dir), PROMPTS * 2)
        weights = [perturbed_model(model_dir, 1), perturbed_model(model_dir, 2)]
        clean = []
        for w in weights:
            gen.refit(w)
            clean.append(gen.generate(batch, greedy=True))
        return cls(batch, weights, clean)

    def tokens(self, which: int, index: int) -> list[int]:
        """Sample ``index``'s fault-free tokens under ``weights[which]``."""
        out = self.clean[which]
        start, length = int(self.batch["input_lengths"][index]), int(out["generation_lengths"][index])
        return out["output_ids"][index, start : start + length].tolist()


def stream_problems(
    results: list[SampleResult], work: Workload, versions: dict[int, int], size: int
) -> list[str]:
    """What is wrong with a streamed rollout's ``results``: a sample lost or repeated, a token
    stamped with a version not current while the rollout ran (``versions``: each such version's
    weights, by index in ``work.weights``), or tokens not those of their version's weights."""
    problems = []
    if sorted(r.index for r in results) != list(range(size)):
        problems.append(f"samples reported {sorted(r.index for r in results)}, not each of {size} once")
    for r in results:
        stamps = [v for v, _ in r.versions]
        if r.versions[0][1] != 0 or stamps != sorted(stamps) or not set(stamps) <= set(versions):
            problems.append(f"sample {r.index}: versions {r.versions}, the rollout ran under {set(versions)}")
            continue
        # a later segment's weights went on from the tokens before it: only the first segment
        # is known, the fault-free output of its version (a prefix of it where more follow)
        want = work.tokens(versions[stamps[0]], r.index)
        end = r.versions[1][1] if len(stamps) > 1 else len(want)
        if r.token_ids[:end] != want[:end] or (len(stamps) == 1 and r.token_ids != want):
            problems.append(f"sample {r.index}: tokens {r.token_ids} of version {stamps[0]}, not {want}")
    return problems


def run_round(gen: Any, work: Workload, n: int, rng: random.Random, killer: Killer) -> dict[str, Any]:
    """One round (weights, a kill landing in a call, the call's checks): the mode, the victim,
    what ``killer`` returned (``kill``) and the problems found."""
    which, mode = n % 2, MODES[n % 3]
    gen.refit(work.weights[which])
    victim = rng.randrange(2)
    kill = killer(gen, victim, rng)
    problems: list[str] = []
    if mode == "generate":
        out = gen.generate(work.batch, greedy=True)
        if not torch.equal(out["output_ids"], work.clean[which]["output_ids"]):
            problems.append("generate's output differs from the fault-free one")
    else:
        size = work.batch["input_ids"].shape[0]
        rollout = gen.submit(work.batch, greedy=True)
        versions = {gen.weight_version: which}
        if mode == "stream_keep":
            gen.refit(work.weights[1 - which], mode="keep")
            versions[gen.weight_version] = 1 - which
        problems += stream_problems(rollout.wait(), work, versions, size)
    return {"round": n, "mode": mode, "victim": victim, "kill": kill, "problems": problems}
