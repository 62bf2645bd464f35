"""Config type of the ``sglang`` backend (light: no sglang import)."""

from typing import Annotated, Any

from pydantic import Field
from typing_extensions import NotRequired

from rollgen.distributed.config import RayEngineCfg
from rollgen.spec import EngineSubDict, GenerationConfig


class SglangCfg(RayEngineCfg):
    mem_fraction_static: NotRequired[Annotated[float, Field(gt=0, le=1, default=0.5)]]
    #: Keep a CPU copy of the weights while asleep (without it, SGLang 0.5.16 resumes with
    #: undefined weights unless a refit follows; see docs/sglang.md).
    enable_weights_cpu_backup: NotRequired[Annotated[bool, Field(default=True)]]
    disable_cuda_graph: NotRequired[Annotated[bool, Field(default=False)]]
    load_format: NotRequired[Annotated[str, Field(default="auto")]]
    #: SGLang honours per-request sampling seeds only with deterministic inference (batch-invariant
    #: kernels, PyTorch sampling). None: on when the config has a ``seed``.
    deterministic_inference: NotRequired[Annotated[bool | None, Field(default=None)]]
    #: The scheduler waits for work instead of polling for it: an idle engine (a trainer's
    #: training step) then leaves its CPU core free. Polling schedulers made rollgen's CPU work
    #: on the same host many times slower (BENCHMARKS.md).
    sleep_on_idle: NotRequired[Annotated[bool, Field(default=True)]]


class SglangConfig(GenerationConfig):
    sglang_cfg: NotRequired[EngineSubDict[SglangCfg]]
    #: Passed to ``sglang.Engine`` as is.
    sglang_kwargs: NotRequired[Annotated[dict[str, Any], Field(default_factory=dict)]]
