"""``SglangGeneration``: the trainer-facing side of the SGLang backend (docs/sglang.md)."""

from __future__ import annotations

from typing import ClassVar

from rollgen.distributed import RayGeneration


class SglangGeneration(RayGeneration):
    """SGLang engines in Ray actors; tensor parallelism is SGLang's own, inside a tied group."""

    worker_cls = "rollgen_sglang.worker:SglangWorker"
    engine_key = "sglang_cfg"
    #: SGLang 0.5.16 takes prompts of at most its context length minus 6 tokens (its
    #: ``max_req_input_len`` is ``context_len - 1 - 5``), and rejects longer ones.
    reserved_context: ClassVar[int] = 6
    #: Each engine joins a weight-sync group as one rank (its worker, which hands SGLang what it
    #: receives), whatever its tensor-parallel size.
    sync_ranks_per_engine: ClassVar[int | None] = 1
