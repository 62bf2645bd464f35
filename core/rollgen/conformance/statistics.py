"""Exact tests for the suite's statistical rules: a sampled token's counts against the
reference's probabilities, with a stated bound on the chance that a correct backend fails."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping

#: The chance that a correct backend fails one of the suite's statistical checks, at most.
FALSE_FAILURE = 1e-6
#: How far an engine's probabilities may be from the reference's (relative): well above what
#: the stated logprob bounds allow (5e-3 on CUDA: 0.5 %).
PROBABILITY_TOLERANCE = 0.01


def binomial_cdf(k: int, n: int, q: float) -> float:
    """P(X <= k) for X ~ Binomial(n, q), exactly (summed in log space)."""
    if k < 0:
        return 0.0
    if k >= n or q <= 0.0:
        return 1.0
    if q >= 1.0:
        return 0.0
    logs = [
        math.lgamma(n + 1)
        - math.lgamma(i + 1)
        - math.lgamma(n - i + 1)
        + i * math.log(q)
        + (n - i) * math.log1p(-q)
        for i in range(k + 1)
    ]
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(x - top) for x in logs))


def implausible_counts(counts: Counter[int], expected: Mapping[int, float], label: str) -> list[str]:
    """Why ``counts`` (token → how often it was sampled, of n draws) cannot come from the
    distribution ``expected`` (token → probability; tokens it leaves out have probability 0):
    a token outside it, or a count in either exact binomial tail below ``FALSE_FAILURE / (2 m)``
    for m tokens (so a correct backend gets any problem with probability below
    ``FALSE_FAILURE``), each probability widened by ``PROBABILITY_TOLERANCE``. Empty: plausible."""
    n = sum(counts.values())
    problems = [
        f"{label}: token {t} sampled {c} of {n} times, but the reference never samples it"
        for t, c in sorted(counts.items())
        if t not in expected and c
    ]
    alpha = FALSE_FAILURE / (2 * len(expected))
    for t, q in sorted(expected.items()):
        c = counts.get(t, 0)
        low, high = q * (1 - PROBABILITY_TOLERANCE), min(1.0, q * (1 + PROBABILITY_TOLERANCE))
        too_few = binomial_cdf(c, n, high)
        too_many = 1.0 - binomial_cdf(c - 1, n, low)
        if min(too_few, too_many) < alpha:
            side, p = ("few", too_few) if too_few < too_many else ("many", too_many)
            problems.append(
                f"{label}: token {t} sampled {c} of {n} times ({c / n:.3f}), expected {q:.3f}: this "
                f"{side} has probability {p:.2g} (< {alpha:.2g})"
            )
    return problems
