"""Broken copies of the hf backend that break a streaming rule (each named in its docstring):
the report of every started sample, once; aborts; kept samples on the new weights. Stand-ins
for the suite's mutation test; each bends the hf backend's own hooks or its reports."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from rollgen.data import BatchedDataDict
from rollgen.refit import load_into_module
from rollgen.rollout import FinishedSample, SampleProgress, SampleRequest
from rollgen.sampling import SampleParams
from rollgen_hf.decode import Decoder
from rollgen_hf.generation import HfGeneration

logger = logging.getLogger(__name__)


class AbortIgnored(HfGeneration):
    """Breaks ``_stream_abort``: ignores it (samples run to their own ends)."""

    def _stream_abort(self, keys: list[str]) -> None:
        pass


class _FilteredReports(HfGeneration):
    """Reports pass through ``reports`` on their way to the core."""

    def __init__(self, config: Mapping[str, Any], cluster: Any = None, backend: Any = None) -> None:
        super().__init__(config, cluster=cluster, backend=backend)
        deliver = self._streams.deliver
        self._streams.deliver = lambda finished: deliver(self.reports(list(finished)))  # type: ignore[method-assign]

    def reports(self, finished: list[FinishedSample]) -> Iterable[FinishedSample]:
        return finished


class AbortedNeverReported(_FilteredReports):
    """Breaks "report every started sample once": a sample ended by an abort is never reported."""

    def reports(self, finished: list[FinishedSample]) -> Iterable[FinishedSample]:
        return [f for f in finished if not f.aborted]


class ReportsTwice(_FilteredReports):
    """Breaks "report every started sample once": reports each one twice."""

    def reports(self, finished: list[FinishedSample]) -> Iterable[FinishedSample]:
        return finished + finished


class LosesASample(_FilteredReports):
    """Breaks "report every started sample once": never reports the first sample of a batch."""

    def reports(self, finished: list[FinishedSample]) -> Iterable[FinishedSample]:
        return [f for f in finished if f.key.split(":")[1] != "0"]


def _continuations(requests: list[SampleRequest]) -> list[SampleRequest]:
    """The requests that continue a sample after a ``keep`` update (its attempt is not 0)."""
    return [r for r in requests if not r.key.endswith(":0")]


class PrefillLosesSamples(HfGeneration):
    """The bug an outside author's backend had: a prefill that fails loses the samples it was
    admitting (here the continuations of a ``keep`` update), logged and never reported."""

    def _stream_start(self, requests: list[SampleRequest]) -> None:
        lost = _continuations(requests)
        if lost:
            logger.error("prefill failed; samples %s dropped", [r.key for r in lost])
        super()._stream_start([r for r in requests if r not in lost])


class PrefillFails(HfGeneration):
    """The same failing prefill, in a backend that follows the guide's rule: every sample it
    started and has not reported is reported with the error (the hf backend's decoding loop
    does this), so the rollout raises instead of waiting for ever."""

    def _cohort(self, requests: list[SampleRequest]) -> Decoder:
        if _continuations(requests):
            raise RuntimeError("prefill failed (a stand-in fault)")
        return super()._cohort(requests)


class WeightsLoadAfterPrefill(HfGeneration):
    """Breaks "a kept sample continues under the new weights": refits are loaded lazily, the
    streamed requests' prefill running before the load (``generate`` loads them first), so the
    tokens after an update are not the new weights' though stamped with the new version."""

    def __init__(self, config: Mapping[str, Any], cluster: Any = None, backend: Any = None) -> None:
        super().__init__(config, cluster=cluster, backend=backend)
        self._pending: list[list[tuple[str, torch.Tensor]]] = []

    def _load_weights(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        self._pending.append([(n, t.clone()) for n, t in named])

    def _load_pending(self) -> None:
        while self._pending:
            load_into_module(self.model, self._pending.pop(0))

    def _generate(self, batch: BatchedDataDict[Any], params: list[SampleParams]) -> BatchedDataDict[Any]:
        self._load_pending()
        return super()._generate(batch, params)

    def _cohort(self, requests: list[SampleRequest]) -> Decoder:
        decoder = super()._cohort(requests)
        self._load_pending()
        return decoder


class ProgressLogprobsOff(HfGeneration):
    """Breaks "the tokens reported while a sample runs are those its end reports": the
    logprobs of its progress reports are off by 0.5 (its end's are right)."""

    def __init__(self, config: Mapping[str, Any], cluster: Any = None, backend: Any = None) -> None:
        super().__init__(config, cluster=cluster, backend=backend)
        progress = self._streams.progress
        self._streams.progress = lambda moved: progress(  # type: ignore[method-assign]
            [SampleProgress(m.key, m.token_ids, tuple(lp - 0.5 for lp in m.logprobs)) for m in moved]
        )
