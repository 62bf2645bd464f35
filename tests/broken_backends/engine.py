"""Broken copies of the example backend (and one of hf) that break an output, refit or sleep
rule (each named in its docstring); stand-ins for the suite's mutation test."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rollgen.data import BatchedDataDict
from rollgen.refit import load_into_module
from rollgen.sampling import SampleParams
from rollgen_example.engine import ExampleGeneration
from rollgen_hf.generation import HfGeneration


class LogprobsSlightlyOff(ExampleGeneration):
    """Breaks the logprob bounds: every generated token's logprob 1e-3 low."""

    def _generate(self, batch: BatchedDataDict[Any], params: list[SampleParams]) -> BatchedDataDict[Any]:
        out = super()._generate(batch, params)
        out["logprobs"] = torch.where(out["logprobs"] != 0, out["logprobs"] - 1e-3, 0.0)
        return out


class LogprobsFloat64(ExampleGeneration):
    """Breaks the output's dtypes: logprobs in float64."""

    def _generate(self, batch: BatchedDataDict[Any], params: list[SampleParams]) -> BatchedDataDict[Any]:
        out = super()._generate(batch, params)
        out["logprobs"] = out["logprobs"].double()
        return out


class StopTokenNotKept(ExampleGeneration):
    """Breaks "a stop token id ends the sample and is kept": the config's stop id is left out."""

    def _generate(self, batch: BatchedDataDict[Any], params: list[SampleParams]) -> BatchedDataDict[Any]:
        out = super()._generate(batch, params)
        stop = set(self.cfg.get("stop_token_ids") or ())
        for i in range(batch.size):
            end = int(out["unpadded_sequence_lengths"][i])
            if int(out["generation_lengths"][i]) > 1 and int(out["output_ids"][i, end - 1]) in stop:
                out["output_ids"][i, end - 1] = self.cfg["pad_token_id"]
                out["logprobs"][i, end - 1] = 0.0
                out["generation_lengths"][i] -= 1
                out["unpadded_sequence_lengths"][i] -= 1
        width = batch["input_ids"].shape[1] + int(out["generation_lengths"].max())
        out["output_ids"], out["logprobs"] = out["output_ids"][:, :width], out["logprobs"][:, :width]
        return out


class OnlyTokenizerEos(ExampleGeneration):
    """Breaks "end a sample at ``p.stop_token_ids``": stops at the tokenizer's EOS alone (not
    the config's stop ids, nor the model's generation-config EOS ids)."""

    def _generate(self, batch: BatchedDataDict[Any], params: list[SampleParams]) -> BatchedDataDict[Any]:
        eos = (self.tokenizer.eos_token_id,)
        only_eos = [
            SampleParams(p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.stop_strings, eos, p.seed)
            for p in params
        ]
        return super()._generate(batch, only_eos)


class RefitIgnored(ExampleGeneration):
    """Breaks refit: takes the buckets and loads nothing."""

    def _load_weights(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        pass


class PartialRefitIntoTheNextLayer(ExampleGeneration):
    """Breaks partial refits: a bucket of one layer's tensors alone is loaded into the next
    layer (the complete model's buckets span layers, and load where they belong)."""

    def _load_weights(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        named = list(named)
        layers = {n.split(".")[2] for n, _ in named if n.startswith("model.layers.")}
        if len(layers) == 1 and all(n.startswith("model.layers.") for n, _ in named):
            (layer,) = layers
            count = self.model.config.num_hidden_layers
            other = f"model.layers.{(int(layer) + 1) % count}."
            named = [(other + n.split(".", 3)[3], t) for n, t in named]
        load_into_module(self.model, named)


class PrefixCacheKeptAcrossRefits(ExampleGeneration):
    """Breaks "no prefix cached under old weights is reused": caches the model's logits by
    sequence and keeps them through refits (no prefix reset linked)."""

    def __init__(self, config: Mapping[str, Any], cluster: Any = None, backend: Any = None) -> None:
        super().__init__(config, cluster=cluster, backend=backend)
        forward = self.model.forward
        cache: dict[tuple[int, ...], Any] = {}

        @functools.wraps(forward)
        def cached(*args: Any, input_ids: torch.Tensor, **kwargs: Any) -> Any:
            key = tuple(input_ids.flatten().tolist())
            if key not in cache:
                cache[key] = forward(*args, input_ids=input_ids, **kwargs)
            return cache[key]

        self.model.forward = cached  # type: ignore[method-assign]


class SleepKeepsServing(HfGeneration):
    """Breaks sleep: says sleep releases memory, and keeps everything where it is."""

    @property
    def releases_memory_on_sleep(self) -> bool:
        return True

    def _sleep(self) -> None:
        pass
