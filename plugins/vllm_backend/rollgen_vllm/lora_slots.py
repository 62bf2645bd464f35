"""Adapter versions written straight into vLLM's LoRA slots.

vLLM keeps each active LoRA in a slot of every LoRA layer's stacked GPU buffers
(``lora_a_stacked[i][slot]``, ``lora_b_stacked[i][slot]``), copied there from a LoRA model it
first builds in host memory, module by module. rollgen writes a new adapter version from the
refit's tensors into a free slot in three fused passes (zero the slot, copy A and B, scale B by
``alpha / rank``, as vLLM scales it), then registers the version with vLLM's LoRA manager as
active in that slot, so a request naming its ``lora_int_id`` decodes with it and vLLM copies
nothing. vLLM holds no other copy of such a version: rollgen never lets vLLM evict one (the
engine has as many slots as ``lora.max_versions``; rollgen frees a version before it adds one),
and a version vLLM tried to bring back into a slot raises rather than serving the model alone."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from rollgen.errors import RefitError


def lora_name_mapper(model: Any) -> Any:
    """The model's HF-to-vLLM renames as vLLM's own LoRA loader applies them to adapter names
    (None: the model has none). vLLM 0.32 calls this ``get_rename_mapper``, 0.26
    ``get_unstacked_mapper``."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None:
        return None
    for method in ("get_rename_mapper", "get_unstacked_mapper"):
        if hasattr(mapper, method):
            return getattr(mapper, method)()
    return mapper


def slot_lora(version: int, rank: int) -> Any:
    """vLLM's record of adapter ``version``, whose weights rollgen wrote into its slot."""
    return _slot_lora_class()(version, rank, {})


@functools.cache
def _slot_lora_class() -> type:
    from vllm.lora.lora_model import LoRAModel

    class SlotLoRA(LoRAModel):
        """A LoRA vLLM holds no weights of: asked for them (to bring it into a slot), it raises."""

        def get_lora(self, module_name: str) -> Any:
            raise RuntimeError(
                f"rollgen adapter version {self.id} left its LoRA slot and vLLM tried to load it "
                "again; rollgen holds lora.max_versions slots and never lets vLLM evict one"
            )

    return SlotLoRA


#: Where an adapter tensor goes: the vLLM LoRA layer's name, its slice (q, k, v of a packed
#: ``qkv_proj``), and whether it is ``lora_A``.
Target = tuple[str, int, bool]


class LoraSlots:
    """Writes adapter versions of PEFT-named tensors into the LoRA slots of one vLLM rank
    (``manager``: its ``model_runner.lora_manager``)."""

    def __init__(self, manager: Any) -> None:
        self.adapters = manager._adapter_manager
        self.layers: dict[str, Any] = dict(self.adapters.modules)
        self.mapper = lora_name_mapper(self.adapters.model)
        #: A packed layer's parts (``...q_proj``) → the layer's name and the part's slice.
        self.parts = {
            part: (packed, i)
            for packed, parts in self.adapters.packed_modules.items()
            for i, part in enumerate(parts)
        }
        self.targets: dict[str, Target] = {}

    def target(self, name: str) -> Target:
        """Where the adapter tensor ``name`` (PEFT's) is written.

        Raises:
            RefitError: the engine has no LoRA layer for it."""
        if name not in self.targets:
            from vllm.lora.utils import parse_fine_tuned_lora_name

            module, is_a = parse_fine_tuned_lora_name(name, self.mapper)
            if module in self.layers:
                self.targets[name] = (module, 0, is_a)
            elif module in self.parts:
                self.targets[name] = (*self.parts[module], is_a)
            else:
                raise RefitError(
                    f"adapter tensor {name}: the engine has no LoRA layer for {module}; the config's "
                    "lora.target_modules must name the layers the engine was started with"
                )
        return self.targets[name]

    def write(
        self, version: int, named: Sequence[tuple[str, torch.Tensor]], rank: int, scaling: float
    ) -> None:
        """Hold ``named`` (a whole adapter of ``rank``, PEFT's names) as adapter ``version``,
        active in a free slot (one of the same id is replaced). Asynchronous on a GPU: the
        caller synchronizes before the tensors may change.

        Raises:
            RefitError: no free slot, or tensors the slots cannot take (nothing is applied)."""
        adapters = self.adapters
        adapters.remove_adapter(version)
        try:
            index = adapters.lora_index_to_id.index(None)
        except ValueError:
            raise RefitError(
                f"vLLM has no free LoRA slot for adapter version {version} "
                f"(slots: {adapters.lora_index_to_id})"
            ) from None
        try:
            self._copy(index, named, scaling)
        except (RuntimeError, ValueError, IndexError) as exc:
            for layer in self.layers.values():
                layer.reset_lora(index)
            raise RefitError(f"vLLM's LoRA slots did not take adapter version {version}: {exc}") from None
        # what vLLM's add_adapter and activate_adapter record, without its copy into the slot
        adapters._registered_adapters[version] = slot_lora(version, rank)
        adapters.lora_index_to_id[index] = version
        adapters._active_adapters[version] = None

    def _copy(self, index: int, named: Sequence[tuple[str, torch.Tensor]], scaling: float) -> None:
        """Zero slot ``index`` of every LoRA layer, then copy ``named`` into it and scale its B."""
        grouped: dict[str, tuple[list[torch.Tensor | None], list[torch.Tensor | None]]] = {}
        for name, tensor in named:
            module, part, is_a = self.target(name)
            slices = self.layers[module].n_slices
            pair = grouped.setdefault(module, ([None] * slices, [None] * slices))
            pair[0 if is_a else 1][part] = tensor
        zero, dsts, srcs, scaled = [], [], [], []
        for module, layer in self.layers.items():
            if module not in grouped:
                layer.reset_lora(index)  # a layer the adapter leaves alone (vLLM resets it too)
                continue
            zero += [stacked[index] for stacked in (*layer.lora_a_stacked, *layer.lora_b_stacked)]
            a, b = grouped[module]
            if layer.tp_size > 1:  # this rank's shard, as vLLM's set_lora takes it
                a, b = _sliced(layer, a, b)
            for i, (a_i, b_i) in enumerate(zip(a, b, strict=True)):
                if a_i is not None:
                    dsts.append(layer.lora_a_stacked[i][index, 0, : a_i.shape[0], : a_i.shape[1]])
                    srcs.append(a_i)
                if b_i is not None:
                    dst = layer.lora_b_stacked[i][index, 0, : b_i.shape[0], : b_i.shape[1]]
                    dsts.append(dst)
                    srcs.append(b_i)
                    scaled.append(dst)
        torch._foreach_zero_(zero)
        torch._foreach_copy_(dsts, srcs)
        if scaling != 1.0:
            torch._foreach_mul_(scaled, scaling)


def _sliced(
    layer: Any, a: list[torch.Tensor | None], b: list[torch.Tensor | None]
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """This rank's shard of each part (``layer.slice_lora_a`` / ``slice_lora_b``: views)."""
    if layer.n_slices == 1:
        return [None if a[0] is None else layer.slice_lora_a(a[0])], [
            None if b[0] is None else layer.slice_lora_b(b[0])
        ]
    return layer.slice_lora_a(a), layer.slice_lora_b(b)
