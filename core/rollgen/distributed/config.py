"""The config keys every Ray-actor backend's engine sub-dict shares (light: imports no Ray, so
a plugin's config type can subclass it at discovery)."""

from typing import Annotated, Literal

from pydantic import Field
from typing_extensions import NotRequired, TypedDict

from rollgen.spec import STRICT, PositiveInt


class RayEngineCfg(TypedDict):
    """Keys every Ray-actor backend's engine sub-dict shares (``vllm_cfg``, ``sglang_cfg``)."""

    __pydantic_config__ = STRICT  # type: ignore[misc]

    tensor_parallel_size: NotRequired[Annotated[PositiveInt, Field(default=1)]]
    #: Engines to start when no cluster is given (with a cluster: its tied groups decide).
    data_parallel_size: NotRequired[Annotated[PositiveInt, Field(default=1)]]
    #: "auto": on where the engine supports it (CUDA), off on CPU.
    enable_sleep_mode: NotRequired[Annotated[bool | Literal["auto"], Field(default="auto")]]
    #: CPU bundles reserve this many Ray CPUs each (fractions leave room on small machines).
    cpus_per_bundle: NotRequired[Annotated[float, Field(gt=0, default=0.5)]]
    #: GPU share each bundle reserves: 1 (a whole GPU) or, for TP=1 only, a fraction so that several
    #: small engines (each with its own memory limit) share a GPU.
    gpus_per_bundle: NotRequired[Annotated[float, Field(gt=0, le=1, default=1.0)]]
    #: What the death of one engine does: "fail" ends the generation (``usable`` False); "replace"
    #: re-runs what it held on the surviving engines and starts a new one in its place, which serves
    #: once it holds the current weights (docs/contract.md, "Failures of engine processes").
    engine_failures: NotRequired[Annotated[Literal["fail", "replace"], Field(default="fail")]]
    #: With "replace": how often one engine is replaced within ``restart_window_s`` seconds; after
    #: that it stays out of service.
    max_restarts: NotRequired[Annotated[PositiveInt, Field(default=3)]]
    restart_window_s: NotRequired[Annotated[float, Field(gt=0, default=3600.0)]]
    #: The engine's own log level: what of its logging reaches the trainer's console (through
    #: Ray's log forwarding).
    log_level: NotRequired[
        Annotated[Literal["debug", "info", "warning", "error", "critical"], Field(default="warning")]
    ]
    #: Seconds the driver waits for an engine's answer to one call (a generate, a refit's bucket,
    #: ...), or for a token from an engine that has streamed samples, before it kills the
    #: engine's worker as wedged: ``WorkerError(died=True)``.
    call_timeout_s: NotRequired[Annotated[float, Field(gt=0, default=3600.0)]]
