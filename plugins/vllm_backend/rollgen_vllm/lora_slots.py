"""Adapter versions written straight into vLLM's LoRA slots.

vLLM keeps each active LoRA in a slot of every LoRA layer's stacked buffers
(``lora_a_stacked[i][slot]``, ``lora_b_stacked[i][slot]``), copied there from a LoRA model it
first builds in host memory, module by module. rollgen writes a new adapter version from the
refit's tensors into a free slot in fused passes (zero what the copy leaves of the slot, copy A
and B, scale B by ``alpha / rank``, as vLLM scales it; the views into each slot, and what goes
where, are worked out once), then registers the version with vLLM's LoRA manager as active in
that slot, so a request naming its ``lora_int_id`` decodes with it and vLLM copies nothing. vLLM
holds no other copy of such a version: rollgen never lets vLLM evict one (the engine has as many
slots as ``lora.max_versions``; rollgen frees a version before it adds one), and a version vLLM
tried to bring back into a slot raises rather than serving the model alone.
This covers plain linear LoRA layers (every projection of a dense model); an adapter of any
other layer goes vLLM's own way (``LoraSlots``)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, cast

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
    (``manager``: its ``model_runner.lora_manager``). An adapter with a tensor for a layer that
    is not a plain linear LoRA layer (vLLM's ``lm_head``, MoE experts, layers whose ``set_lora``
    splits or expands the parts) or for no LoRA layer goes vLLM's own way instead: a LoRA built
    from copies of its tensors on this rank's device, added and brought into a slot by vLLM."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.adapters = manager._adapter_manager
        self.layers: dict[str, Any] = dict(self.adapters.modules)
        self.mapper = lora_name_mapper(self.adapters.model)
        #: A packed layer's parts (``...q_proj``) → the layer's name and the part's slice.
        self.parts = {
            part: (packed, i)
            for packed, parts in self.adapters.packed_modules.items()
            if len(parts) == getattr(self.layers.get(packed), "n_slices", None)
            for i, part in enumerate(parts)
        }
        self.targets: dict[str, Target | None] = {}
        #: Views into the slots, made once (slicing ~800 views a write costs milliseconds).
        self._slots: dict[tuple[str, int], _SlotViews] = {}
        #: Each slot's write of each adapter layout (its Python per tensor costs milliseconds).
        self._writes: dict[tuple[int, tuple[str, ...]], _SlotWrite] = {}

    def target(self, name: str) -> Target | None:
        """Where the adapter tensor ``name`` (PEFT's) is written; None: not into a plain
        linear LoRA layer's slot."""
        if name not in self.targets:
            from vllm.lora.utils import parse_fine_tuned_lora_name

            module, is_a = parse_fine_tuned_lora_name(name, self.mapper)
            found = (module, 0) if module in self.layers else self.parts.get(module)
            self.targets[name] = (*found, is_a) if found and _plain(self.layers[found[0]]) else None
        return self.targets[name]

    def write(self, version: int, named: Sequence[tuple[str, torch.Tensor]], setup: dict[str, Any]) -> None:
        """Hold ``named`` (a whole adapter of PEFT setup ``setup``, PEFT's names) as adapter
        ``version``, active in a slot (one of the same id is replaced first). Asynchronous on a
        GPU: the caller synchronizes before the tensors may change.

        Raises:
            RefitError: no free slot, or tensors the engine cannot take (the other versions
                serve as they did)."""
        adapters = self.adapters
        adapters.remove_adapter(version)
        if any(self.target(name) is None for name, _ in named):
            self._add_built(version, named, setup)
            return
        try:
            index = adapters.lora_index_to_id.index(None)
        except ValueError:
            raise RefitError(
                f"vLLM has no free LoRA slot for adapter version {version} "
                f"(slots: {adapters.lora_index_to_id})"
            ) from None
        rank = int(setup["r"])
        try:
            self._copy(index, named, float(setup["lora_alpha"]) / rank)
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:
            for layer in self.layers.values():
                layer.reset_lora(index)
            raise RefitError(f"vLLM's LoRA slots did not take adapter version {version}: {exc}") from None
        # what vLLM's add_adapter and activate_adapter record, without its copy into the slot
        adapters._registered_adapters[version] = slot_lora(version, rank)
        adapters.lora_index_to_id[index] = version
        adapters._active_adapters[version] = None

    def _copy(self, index: int, named: Sequence[tuple[str, torch.Tensor]], scaling: float) -> None:
        """Copy ``named`` into slot ``index`` of each layer it adapts, zero the rest of that
        slot (a smaller rank than the slot's, a part left out) and scale its B: fused passes;
        reset the slot of the layers it leaves alone, as vLLM does. What goes where is worked
        out once for each slot and adapter layout (its names: the driver checked their shapes
        against the adapter spec) and kept, except where this rank takes a shard of each tensor
        (TP)."""
        key = tuple(name for name, _ in named)
        write = self._writes.get((index, key))
        if write is not None and write.current():
            srcs = [named[i][1] for i in cast(list[int], write.order)]
        else:
            write, srcs = self._plan(index, named)
            if write.order is not None:
                self._writes[index, key] = write
        write.run(index, srcs, scaling)

    def _plan(
        self, index: int, named: Sequence[tuple[str, torch.Tensor]]
    ) -> tuple[_SlotWrite, list[torch.Tensor]]:
        """Where each of ``named`` goes in slot ``index``, and the tensors copied there."""
        grouped: dict[str, tuple[list[int | None], list[int | None]]] = {}
        for n, (name, _) in enumerate(named):
            module, part, is_a = cast(Target, self.target(name))
            slices = self.layers[module].n_slices
            where = grouped.setdefault(module, ([None] * slices, [None] * slices))
            where[0 if is_a else 1][part] = n
        write = _SlotWrite()
        srcs: list[torch.Tensor] = []
        for module, layer in self.layers.items():
            if module not in grouped:
                write.reset.append(layer)  # a layer the adapter leaves alone
                continue
            views = self._views(module, layer, index)
            write.views.append((views, layer))
            ia, ib = grouped[module]
            a = [None if i is None else named[i][1] for i in ia]
            b = [None if i is None else named[i][1] for i in ib]
            if layer.tp_size > 1:  # this rank's shard, as vLLM's set_lora takes it: views made each time
                a, b = _sliced(layer, a, b)
                write.order = None
            for part, factors in enumerate(zip(a, b, strict=True)):
                for is_a, tensor, i in zip((True, False), factors, (ia[part], ib[part])):
                    slot = views.slot(part, is_a)
                    if tensor is None or tensor.numel() != slot.numel():
                        write.zero.append(slot)  # what the copy leaves of the slot (a smaller rank)
                    if tensor is None:
                        continue
                    dst = views.dst(part, is_a, tensor.shape)
                    write.dsts.append(dst)
                    srcs.append(tensor)
                    if write.order is not None:
                        write.order.append(cast(int, i))
                    if not is_a:
                        write.scaled.append(dst)
        return write, srcs

    def _views(self, module: str, layer: Any, index: int) -> _SlotViews:
        """The views into slot ``index`` of ``layer`` (made again where vLLM replaced its
        stacked buffers)."""
        views = self._slots.get((module, index))
        if views is None or not views.of(layer):
            views = self._slots[module, index] = _SlotViews(layer, index)
        return views

    def _add_built(
        self, version: int, named: Sequence[tuple[str, torch.Tensor]], setup: dict[str, Any]
    ) -> None:
        """vLLM's own way: build the LoRA of copies of ``named`` (vLLM scales B in place and
        keeps them) on this rank's device, add it, and bring it into a slot."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        manager, adapters = self.manager, self.adapters
        try:
            helper = PEFTHelper.from_dict(setup)
            helper.validate_legal(manager.lora_config)
            lora = LoRAModel.from_lora_tensors(
                lora_model_id=version,
                tensors={name: t.clone() for name, t in named},
                peft_helper=helper,
                device=str(named[0][1].device),
                dtype=manager.lora_config.lora_dtype,
                model_vocab_size=manager.vocab_size,
                weights_mapper=self.mapper,
                skip_prefixes=getattr(adapters.model, "lora_skip_prefixes", None),
            )
            adapters.add_adapter(lora)
            adapters.activate_adapter(version)
        except (ValueError, RuntimeError, KeyError) as exc:
            adapters.remove_adapter(version)
            raise RefitError(f"vLLM did not take adapter version {version}: {exc}") from None


class _SlotWrite:
    """One adapter layout's write into one slot: the layers it leaves alone (``reset``), the
    views into the slot it zeroes, copies into (from the adapter's tensors ``order``; None:
    shards made each time) and scales, and the views it was made of."""

    def __init__(self) -> None:
        self.reset: list[Any] = []
        self.views: list[tuple[_SlotViews, Any]] = []
        self.zero: list[torch.Tensor] = []
        self.dsts: list[torch.Tensor] = []
        self.order: list[int] | None = []
        self.scaled: list[torch.Tensor] = []

    def current(self) -> bool:
        """Whether the views are of the layers' buffers as they are now."""
        return all(views.of(layer) for views, layer in self.views)

    def run(self, index: int, srcs: list[torch.Tensor], scaling: float) -> None:
        """Write ``srcs`` (in ``dsts``' order) into slot ``index``, B scaled by ``scaling``."""
        for layer in self.reset:
            layer.reset_lora(index)
        if self.zero:  # none where every part's A and B fill their slot
            torch._foreach_zero_(self.zero)
        torch._foreach_copy_(self.dsts, srcs)
        if scaling != 1.0 and self.scaled:
            torch._foreach_mul_(self.scaled, scaling)


class _SlotViews:
    """Views into one slot of one LoRA layer's stacked buffers: the whole slot of a part's A or
    B (``slot``), and where a part's A or B of a shape is copied (``dst``)."""

    def __init__(self, layer: Any, index: int) -> None:
        self.stacked = (layer.lora_a_stacked, layer.lora_b_stacked)
        self.index = index
        self._slots = {
            (part, is_a): buffer[index]
            for is_a, buffers in zip((True, False), self.stacked)
            for part, buffer in enumerate(buffers)
        }
        self._dsts: dict[tuple[int, bool, torch.Size], torch.Tensor] = {}

    def slot(self, part: int, is_a: bool) -> torch.Tensor:
        """The whole slot of a part's A (``is_a``) or B."""
        return self._slots[part, is_a]

    def of(self, layer: Any) -> bool:
        """Whether these view ``layer``'s buffers as they are now."""
        return self.stacked[0] is layer.lora_a_stacked and self.stacked[1] is layer.lora_b_stacked

    def dst(self, part: int, is_a: bool, shape: torch.Size) -> torch.Tensor:
        key = (part, is_a, shape)
        view = self._dsts.get(key)
        if view is None:
            buffer = self.stacked[0 if is_a else 1][part]
            view = self._dsts[key] = buffer[self.index, 0, : shape[0], : shape[1]]
        return view


def _plain(layer: Any) -> bool:
    """Whether ``layer`` is a linear LoRA layer whose ``set_lora`` copies each part's A and B
    into its own slice (what ``LoraSlots._copy`` does in its place)."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from vllm.lora.layers.column_parallel_linear import MergedColumnParallelLinearWithLoRA

    plain = (BaseLinearLayerWithLoRA.set_lora, MergedColumnParallelLinearWithLoRA.set_lora)
    return isinstance(layer, BaseLinearLayerWithLoRA) and type(layer).set_lora in plain


def _sliced(
    layer: Any, a: list[torch.Tensor | None], b: list[torch.Tensor | None]
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """This rank's shard of each part (``layer.slice_lora_a`` / ``slice_lora_b``: views)."""
    if layer.n_slices == 1:
        return [None if a[0] is None else layer.slice_lora_a(a[0])], [
            None if b[0] is None else layer.slice_lora_b(b[0])
        ]
    return layer.slice_lora_a(a), layer.slice_lora_b(b)
