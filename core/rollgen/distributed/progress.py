"""``PackedProgress``: the new tokens of streaming samples as an engine worker's ``poll`` carries
them to the driver, in columns (keys, counts, token ids, logprobs) instead of an object per
sample: a poll of many samples pickles and unpickles in a few array copies."""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rollgen.rollout import SampleProgress


@dataclass(frozen=True)
class PackedProgress:
    """Sample ``keys[i]`` made ``counts[i]`` tokens: the next ``counts[i]`` of ``token_ids`` and
    of ``logprobs`` (float64: the engine's values as they are)."""

    keys: Sequence[str]
    counts: array[int]
    token_ids: array[int]
    logprobs: array[float]

    @classmethod
    def pack(cls, moved: Mapping[str, tuple[Sequence[int], Sequence[float]]]) -> PackedProgress:
        """``moved``: each sample's new token ids and their logprobs."""
        token_ids: array[int] = array("q")
        logprobs: array[float] = array("d")
        for tokens, lps in moved.values():
            token_ids.extend(tokens)
            logprobs.extend(lps)
        counts = array("I", [len(tokens) for tokens, _ in moved.values()])
        return cls(list(moved), counts, token_ids, logprobs)

    def unpack(self) -> list[SampleProgress]:
        reports, at = [], 0
        for key, n in zip(self.keys, self.counts):
            end = at + n
            reports.append(SampleProgress(key, tuple(self.token_ids[at:end]), tuple(self.logprobs[at:end])))
            at = end
        return reports
