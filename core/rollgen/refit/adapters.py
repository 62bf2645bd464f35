"""LoRA adapters as a refit target: the spec of the adapter an engine takes (PEFT's state-dict
names, shapes and dtype for each target layer), reading an adapter from a PEFT model, a state dict
or a PEFT folder, merging one into the model's weights, and the versions an engine holds."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import torch

from rollgen.errors import ConfigError, InputError, RefitError
from rollgen.refit.meta import Named, WeightSpec
from rollgen.spec import DEFAULT_LORA_TARGETS

#: The prefix of every name in PEFT's adapter state dict of a causal LM
#: (``peft.get_peft_model_state_dict``): ``base_model.model.<layer>.lora_A.weight``.
PEFT_PREFIX = "base_model.model."


#: What a refit loads: the model's weights, or a LoRA adapter (a new adapter version).
RefitTarget = Literal["weights", "adapter"]


def is_adapter(target: str, partial: bool, buckets: int = 1) -> bool:
    """Whether a refit's ``target`` is an adapter.

    Raises:
        InputError: an unknown target. RefitError: a partial adapter update, or one in other
            than one bucket."""
    if target not in get_args(RefitTarget):
        raise InputError(f"refit target {target!r}: use one of {list(get_args(RefitTarget))}")
    if target == "adapter" and (partial or buckets != 1):
        raise RefitError(
            "an adapter update sends the whole adapter in one bucket (partial=False; "
            f"got {'partial=True' if partial else f'{buckets} buckets'})"
        )
    return target == "adapter"


def lora_settings(lora: Mapping[str, Any]) -> tuple[int, float, list[str]]:
    """The config's ``lora`` as (rank, alpha, target modules): alpha is the rank and the targets
    every projection unless it names them."""
    rank = int(lora["rank"])
    return rank, float(lora.get("alpha") or rank), list(lora.get("target_modules") or DEFAULT_LORA_TARGETS)


def peft_setup(lora: Mapping[str, Any]) -> dict[str, Any]:
    """The PEFT setup (``adapter_config.json``'s keys) of the config's ``lora``."""
    rank, alpha, targets = lora_settings(lora)
    return {"r": rank, "lora_alpha": alpha, "target_modules": targets}


@dataclass(frozen=True)
class AdapterSpec:
    """The adapter an engine takes.

    Args:
        weights: PEFT name → (shape, dtype): ``lora_A`` [rank, in] and ``lora_B`` [out, rank] of
            each target layer, in the engine's dtype.
        layers: the model's names of those layers (``model.layers.0.self_attn.q_proj``).
        rank: the adapters' rank. scaling: ``alpha / rank``, what ``B·A`` is scaled by."""

    weights: WeightSpec
    layers: tuple[str, ...]
    rank: int
    scaling: float

    @classmethod
    def of(cls, lora: Mapping[str, Any], model: WeightSpec) -> AdapterSpec:
        """The spec of the config's ``lora`` on the model of ``model`` (its ``WeightSpec``).

        Raises:
            ConfigError: a target that is an embedding, or targets that name no linear layer."""
        rank, alpha, names = lora_settings(lora)
        targets = set(names)
        weights, layers = WeightSpec(), []
        for name, (shape, dtype) in model.items():
            layer, _, leaf = name.rpartition(".")
            if leaf != "weight" or len(shape) != 2 or layer.rpartition(".")[2] not in targets:
                continue
            if name in model.tied or "embed" in layer:
                raise ConfigError(f"lora.target_modules: {layer} is an embedding; adapt linear layers only")
            out_features, in_features = shape
            weights[f"{PEFT_PREFIX}{layer}.lora_A.weight"] = ((rank, in_features), dtype)
            weights[f"{PEFT_PREFIX}{layer}.lora_B.weight"] = ((out_features, rank), dtype)
            layers.append(layer)
        if not layers:
            raise ConfigError(
                f"lora.target_modules {sorted(targets)} name no linear layer of the model (its layers' "
                f"names end in {sorted({n.rpartition('.')[0].rpartition('.')[2] for n in model})})"
            )
        return cls(weights, tuple(layers), rank, alpha / rank)

    def factors(self, named: Named) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each target layer's (A, B), from a checked adapter's named tensors."""
        tensors = dict(named)
        return {
            layer: (
                tensors[f"{PEFT_PREFIX}{layer}.lora_A.weight"],
                tensors[f"{PEFT_PREFIX}{layer}.lora_B.weight"],
            )
            for layer in self.layers
        }


def no_lora(engine: str) -> RefitError:
    """The error of an adapter refit that reaches an engine started without the config's lora."""
    return RefitError(f"{engine} was started without the config's lora; it holds no adapters")


def adapter_tensors(source: Any) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of an adapter: a PEFT model's (its active adapter, PEFT's names) or an
    adapter state dict's.

    Raises:
        RefitError: for anything else."""
    if isinstance(source, torch.nn.Module):
        if not hasattr(source, "peft_config"):
            raise RefitError(
                "an adapter refit takes a PEFT model or its adapter state dict "
                "(peft.get_peft_model_state_dict(model)); this module holds no adapter"
            )
        from peft import get_peft_model_state_dict

        return list(get_peft_model_state_dict(source).items())
    if isinstance(source, Mapping):
        return list(source.items())
    raise RefitError(f"an adapter refit takes a PEFT model or a state dict, not {type(source).__name__}")


def read_peft_folder(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A PEFT LoRA folder's setup (the config's ``lora``) and its tensors (an adapter refit's
    source): ``adapter_config.json`` and ``adapter_model.safetensors``.

    Raises:
        ConfigError: a folder without them, or a setup rollgen does not serve (DoRA, rsLoRA,
            per-layer ranks or layers, trained biases or whole modules, targets given as a
            regular expression)."""
    from safetensors.torch import load_file

    folder = Path(path)
    try:
        setup = json.loads((folder / "adapter_config.json").read_text())
        tensors = load_file(folder / "adapter_model.safetensors")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{folder} is not a PEFT adapter folder: {exc}") from None
    keys = (
        "use_dora",
        "use_rslora",
        "rank_pattern",
        "alpha_pattern",
        "layers_to_transform",
        "modules_to_save",
    )
    unsupported = [k for k in keys if setup.get(k)] + [
        f"bias {b!r}" for b in [setup.get("bias")] if b not in (None, "none")
    ]
    targets = setup.get("target_modules")
    if unsupported or not isinstance(targets, list):
        raise ConfigError(
            f"{folder}: a LoRA setup rollgen serves has one rank and alpha and a list of target modules "
            f"(this one: {unsupported or f'target_modules {targets!r}'})"
        )
    lora = {"rank": int(setup["r"]), "alpha": float(setup.get("lora_alpha") or setup["r"])}
    return {**lora, "target_modules": sorted(targets)}, tensors


@torch.no_grad()
def merged(weights: Mapping[str, torch.Tensor], adapter: Named, spec: AdapterSpec) -> dict[str, torch.Tensor]:
    """``weights`` (the model's state dict) with ``adapter`` merged in: ``W + scaling · B·A`` for
    each target layer, computed in float32 and cast back to W's dtype."""
    out = dict(weights)
    for layer, (a, b) in spec.factors(adapter).items():
        w = weights[f"{layer}.weight"]
        out[f"{layer}.weight"] = (w.float() + spec.scaling * (b.float() @ a.float())).to(w.dtype)
    return out


class AdapterVersions:
    """The adapter versions an engine holds, oldest first (at most ``capacity``): ``current``
    serves new samples; older ones stay while samples in flight decode with them. Each adapter
    refit makes a new version (ids never reused)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: list[int] = []
        self.current: int | None = None
        self.last = 0

    def to_drop(self, in_use: set[int]) -> list[int]:
        """The versions to drop so that one more fits: the oldest that is neither current nor
        in use.

        Raises:
            RefitError: every version held is current or in use."""
        if len(self.held) < self.capacity:
            return []
        for version in self.held:
            if version != self.current and version not in in_use:
                return [version]
        raise RefitError(
            f"the engine holds lora.max_versions={self.capacity} adapter versions and samples in flight "
            "decode with each older one; nothing was applied. Let them finish, refit with mode='wait' or "
            "'abort', or raise lora.max_versions"
        )

    def added(self, version: int) -> None:
        self.held.append(version)
        self.current = version
