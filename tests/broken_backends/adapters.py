"""Broken copies of the hf backend that break an adapter rule (each named in its docstring):
stand-ins for the suite's mutation test."""

from __future__ import annotations

import dataclasses

import torch

from rollgen.refit import Named
from rollgen.sampling import SampleParams
from rollgen_hf.adapters import LoraLayers
from rollgen_hf.decode import Decoder
from rollgen_hf.generation import HfGeneration


class AdapterNotApplied(HfGeneration):
    """Breaks "every sample decodes with its adapter version": requests run the model alone (the
    adapter was not named on the request's path: verl #5220, Miles #2075)."""

    def _decoder(
        self, input_ids: torch.Tensor, input_lengths: torch.Tensor, params: list[SampleParams]
    ) -> Decoder:
        alone = [dataclasses.replace(p, adapter=None) for p in params]
        return super()._decoder(input_ids, input_lengths, alone)


class _FirstTensorsOnly(LoraLayers):
    """Every version after the first holds the first one's tensors."""

    def load(self, version: int, named: Named) -> None:
        if self.versions:
            self.versions[version] = next(iter(self.versions.values()))
        else:
            super().load(version, named)


class AdapterReloadedUnderOneName(HfGeneration):
    """Breaks "each adapter refit is a version of its own": every version after the first serves
    the first one's tensors, as an engine that keys what it loaded (or its prefix cache) by an
    adapter name reused for new tensors does (vLLM #42125)."""

    adapters_cls = _FirstTensorsOnly
