"""rollgen: rollout generation for RL post-training, one contract over many engines."""

from typing import TYPE_CHECKING

from rollgen.api import create_generation
from rollgen.backend import Backend
from rollgen.base import BaseGeneration
from rollgen.data import BatchedDataDict
from rollgen.errors import (
    BackendNotFound,
    BackendUnavailable,
    ConfigError,
    EngineAsleep,
    EngineClosed,
    InputError,
    OutputError,
    PluginError,
    RefitError,
    RollgenError,
    RolloutsInFlight,
    StaleWeights,
    UnsupportedCapability,
    WorkerError,
)
from rollgen.hookspecs import hookimpl
from rollgen.interface import GenerationInterface
from rollgen.output import generated_mask
from rollgen.refit import WeightBucket, iter_buckets, merge_buckets, pack_bucket
from rollgen.refit.transports.collective import SyncGroupSpec, WeightSender
from rollgen.registry import get_registry
from rollgen.rollout import Rollout, SampleResult, TokenDelta, UpdateMode
from rollgen.spec import (
    SPEC_VERSION,
    Capability,
    GenerationConfig,
    GenerationDatumSpec,
    GenerationOutputSpec,
)

if TYPE_CHECKING:
    from rollgen.serving import serve

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``rollgen.serve`` (``rollgen.serving.serve``), imported on first use: it needs the
    ``serve`` extra."""
    if name == "serve":
        from rollgen.serving import serve

        return serve
    raise AttributeError(f"module 'rollgen' has no attribute {name!r}")


__all__ = [
    "SPEC_VERSION",
    "Backend",
    "BackendNotFound",
    "BackendUnavailable",
    "BaseGeneration",
    "BatchedDataDict",
    "Capability",
    "ConfigError",
    "EngineAsleep",
    "EngineClosed",
    "GenerationConfig",
    "GenerationDatumSpec",
    "GenerationInterface",
    "GenerationOutputSpec",
    "InputError",
    "OutputError",
    "PluginError",
    "RefitError",
    "RollgenError",
    "Rollout",
    "RolloutsInFlight",
    "SampleResult",
    "StaleWeights",
    "SyncGroupSpec",
    "TokenDelta",
    "UnsupportedCapability",
    "UpdateMode",
    "WeightBucket",
    "WeightSender",
    "WorkerError",
    "__version__",
    "create_generation",
    "generated_mask",
    "get_registry",
    "hookimpl",
    "iter_buckets",
    "merge_buckets",
    "pack_bucket",
    "serve",
]
