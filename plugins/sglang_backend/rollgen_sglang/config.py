"""Config type of the ``sglang`` backend (light: no sglang import)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field
from typing_extensions import NotRequired

from rollgen.spec import GenerationConfig, RayEngineCfg


class SglangCfg(RayEngineCfg):
    mem_fraction_static: NotRequired[Annotated[float, Field(gt=0, le=1)]]
    #: Keep a CPU copy of the weights while asleep (without it, SGLang 0.5.16 resumes with
    #: undefined weights unless a refit follows; see docs/sglang.md).
    enable_weights_cpu_backup: NotRequired[bool]
    disable_cuda_graph: NotRequired[bool]
    load_format: NotRequired[str]
    log_level: NotRequired[str]
    #: SGLang honours per-request sampling seeds only with deterministic inference (batch-invariant
    #: kernels, PyTorch sampling). None: on when the config has a ``seed``.
    deterministic_inference: NotRequired[bool | None]
    #: The scheduler waits for work instead of polling for it: an idle engine (a trainer's
    #: training step) then leaves its CPU core free. Polling schedulers made rollgen's CPU work
    #: on the same host 13x slower (BENCHMARKS.md, session 8).
    sleep_on_idle: NotRequired[bool]


SGLANG_CFG_DEFAULTS: dict[str, Any] = {
    "mem_fraction_static": 0.5,
    "enable_weights_cpu_backup": True,
    "disable_cuda_graph": False,
    "load_format": "auto",
    "log_level": "error",
    "deterministic_inference": None,
    "sleep_on_idle": True,
}


class SglangConfig(GenerationConfig):
    sglang_cfg: NotRequired[SglangCfg]
    #: Passed to ``sglang.Engine`` as is.
    sglang_kwargs: NotRequired[dict[str, Any]]
