"""LoRA adapter versions on a transformers model, by forward hooks on its target linear layers:
each row of a forward adds ``scaling · B·A·x`` of the adapter version it decodes with."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from rollgen.refit import Named, WeightSpec
from rollgen.refit.adapters import AdapterSpec
from rollgen.sampling import SampleParams


class LoraLayers:
    """The adapter versions a model holds (immutable copies of their factors) and the hooks
    that apply them: ``bound(rows)`` is the model with each row of its batch on its version
    (None: the model alone)."""

    def __init__(self, model: torch.nn.Module, spec: AdapterSpec) -> None:
        self.model, self.spec = model, spec
        self.versions: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._rows = threading.local()
        modules = dict(model.named_modules())
        for layer in spec.layers:
            modules[layer].register_forward_hook(partial(self._hook, layer))

    @classmethod
    def of(cls, model: torch.nn.Module, lora: Mapping[str, Any] | None) -> LoraLayers | None:
        """The adapter versions ``model`` serves with the config's ``lora`` (None: none)."""
        return None if lora is None else cls(model, AdapterSpec.of(lora, WeightSpec.of_module(model)))

    def load(self, version: int, named: Named) -> None:
        """Hold a checked adapter as ``version`` (copied: the source may change after)."""
        device = next(self.model.parameters()).device
        self.versions[version] = {
            layer: (a.to(device, copy=True), b.to(device, copy=True))
            for layer, (a, b) in self.spec.factors(named).items()
        }

    def drop(self, version: int) -> None:
        self.versions.pop(version, None)

    def bound(self, rows: Sequence[int | None]) -> Any:
        """The model, called with each batch row on its adapter version (``rows``)."""
        return _Bound(self, list(rows)) if any(r is not None for r in rows) else self.model

    def forward(self, rows: list[int | None], kwargs: dict[str, Any]) -> Any:
        """The model's forward with batch row ``i`` on adapter version ``rows[i]``."""
        self._rows.rows = rows
        try:
            return self.model(**kwargs)
        finally:
            self._rows.rows = None

    @torch.no_grad()
    def _hook(self, layer: str, module: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> Any:
        rows: list[int | None] | None = getattr(self._rows, "rows", None)
        if rows is None:
            return None
        x, scaling = inputs[0], self.spec.scaling
        for version in dict.fromkeys(r for r in rows if r is not None):
            a, b = self.versions[version][layer]
            picked = [i for i, r in enumerate(rows) if r == version]
            if len(picked) == len(rows):
                return output + scaling * F.linear(F.linear(x, a), b)
            index = torch.tensor(picked, device=x.device)
            output = output.index_add(0, index, scaling * F.linear(F.linear(x[index], a), b))
        return output


def serving(model: torch.nn.Module, adapters: LoraLayers | None, params: Sequence[SampleParams]) -> Any:
    """``model`` with each row of a batch on its sample's adapter version (``params``)."""
    return model if adapters is None else adapters.bound([p.adapter for p in params])


class _Bound:
    """A model whose forwards run with a row → adapter version map set (``LoraLayers.bound``)."""

    def __init__(self, layers: LoraLayers, rows: list[int | None]) -> None:
        self._layers, self._rows = layers, rows

    def parameters(self) -> Any:
        return self._layers.model.parameters()

    def __call__(self, **kwargs: Any) -> Any:
        return self._layers.forward(self._rows, kwargs)
