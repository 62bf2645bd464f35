"""``VllmGeneration``: the trainer-facing side of the vLLM backend (docs/vllm.md)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar

from rollgen.distributed import RayGeneration
from rollgen.distributed.generation import EnginePlan
from rollgen_vllm.extension import EXTENSION, check_extension
from rollgen_vllm.worker import VllmWorker, check_lora_dtype

#: Bounds of the KV cache an engine on CPU gets when the config sets none.
CPU_KV_CACHE_BYTES = (256 << 20, 4 << 30)


def cpu_kv_cache_bytes(engines: int, memory_bytes: int) -> int:
    """The KV cache of one of ``engines`` CPU engines on a machine with ``memory_bytes``: an
    eighth of the memory shared between them, within ``CPU_KV_CACHE_BYTES``."""
    low, high = CPU_KV_CACHE_BYTES
    return max(low, min(high, memory_bytes // 8 // engines))


def machine_defaults(engine: dict[str, Any], use_gpus: bool) -> dict[str, Any]:
    """``engine`` (a ``vllm_cfg`` with every default) with its machine-dependent values set:
    the engine core in process on CPU, and a KV cache that fits the machine's memory."""
    engine = dict(engine)
    if engine["in_process"] == "auto":
        engine["in_process"] = not use_gpus
    if not use_gpus and engine["kv_cache_memory_bytes"] is None:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        engines = engine["data_parallel_size"]
        engine["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(engines, memory)
    return engine


class VllmGeneration(RayGeneration):
    """vLLM engines in Ray actors. Logprobs are vLLM's raw logprobs."""

    worker_cls = "rollgen_vllm.worker:VllmWorker"
    engine_key = "vllm_cfg"
    #: vLLM refuses temperatures above 2 (``SamplingParams``, 0.32).
    sampling_limits: ClassVar[Mapping[str, tuple[float | None, float | None]]] = {"temperature": (None, 2.0)}

    def machine_defaults(self, engine: dict[str, Any], use_gpus: bool) -> dict[str, Any]:
        return machine_defaults(engine, use_gpus)

    @property
    def refits_in_place(self) -> bool:
        return bool(self.cfg[self.engine_key]["refit_in_place"])

    def make_plan(self, use_gpus: bool) -> EnginePlan:
        plan = super().make_plan(use_gpus)
        check_extension(plan.spec.engine_kwargs.get("worker_extension_cls", EXTENSION))
        check_lora_dtype(plan.spec)
        return plan

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[list[Any]]:
        """Call ``method`` of the worker extension on every TP rank of every engine (as
        ``vllm.LLM.collective_rpc`` does for one); results per engine, then per rank. With a
        ``vllm_kwargs["worker_extension_cls"]`` subclassing
        ``rollgen_vllm.extension.RollgenWorkerExtension``, its own methods are reachable too."""
        self._check_open()
        return self.engines.call(VllmWorker.collective_rpc, method, args, kwargs)
