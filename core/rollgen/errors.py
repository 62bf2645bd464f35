"""The one error hierarchy of rollgen. Every failure a user can act on is one of these."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class RollgenError(Exception):
    """Base class of every error rollgen raises on purpose. Picklable with its attributes
    (errors raised in engine processes reach the caller as themselves)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), str(self), self.__dict__)


def _rebuild(cls: type[RollgenError], message: str, attributes: dict[str, Any]) -> RollgenError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(attributes)
    return error


class BackendNotFound(RollgenError, LookupError):
    """No registered backend has the requested name."""


class BackendUnavailable(RollgenError):
    """The backend's plugin is installed but its engine cannot be imported (or the plugin is
    broken); the cause is chained."""


class PluginError(RollgenError):
    """A plugin registered something invalid (bad name, duplicate, bad capability)."""


class ConfigError(RollgenError, ValueError):
    """The generation config is invalid. ``problems`` lists every problem found."""

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        self.problems = list(problems)
        if self.problems:
            message = message + "\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message)


class InputError(RollgenError, ValueError):
    """A batch violates the input contract. ``samples`` names the offending sample indices;
    nothing was sent to the engine, which stays usable."""

    def __init__(self, message: str, samples: Sequence[int] = ()) -> None:
        self.samples = [int(s) for s in samples]
        super().__init__(message)


class UnsupportedCapability(RollgenError, NotImplementedError):
    """The backend does not declare the capability the call needs."""

    def __init__(self, backend: str, capability: str, what: str) -> None:
        self.backend = backend
        self.capability = capability
        super().__init__(
            f"backend {backend!r} does not support {what} (capability {capability!r} is not "
            f"declared); `rollgen backends` lists each backend's capabilities"
        )


class RefitError(RollgenError):
    """A weight update was rejected or failed. When raised by validation nothing was applied and
    the engine keeps serving its previous weights. ``stale``: part of the update reached the
    engine before it failed, so the generation refuses to generate until a complete refit."""

    def __init__(self, message: str, problems: Sequence[str] = (), *, stale: bool = False) -> None:
        self.problems = list(problems)
        self.stale = stale
        if self.problems:
            shown = self.problems[:20]
            more = len(self.problems) - len(shown)
            message = message + "\n" + "\n".join(f"  - {p}" for p in shown)
            if more:
                message += f"\n  ... and {more} more"
        super().__init__(message)


class WorkerError(RollgenError):
    """A remote worker died or raised. ``worker`` names it; ``remote_traceback`` keeps the
    worker's own traceback when there is one; ``died``: the worker is gone; with
    ``engine_failures: "fail"`` (the default) the generation object with it (every later call
    raises this again; create a new one), with ``"replace"`` only once no replica is left."""

    def __init__(
        self, worker: str, message: str, remote_traceback: str | None = None, *, died: bool = False
    ) -> None:
        self.worker = worker
        self.remote_traceback = remote_traceback
        self.died = died
        text = f"worker {worker}: {message}"
        if remote_traceback:
            text += "\n--- remote traceback ---\n" + remote_traceback
        super().__init__(text)


class EngineClosed(RollgenError):
    """The generation object was shut down; create a new one."""


class EngineAsleep(RollgenError):
    """The engine is asleep (or only partly awake) for what was asked; call
    ``prepare_for_generation()`` first."""


class StaleWeights(RollgenError):
    """A weight update failed after part of it was applied: the engine (or some of its replicas)
    may hold a mix of old and new weights. Nothing is generated until a complete refit
    succeeds."""


class RolloutsInFlight(RollgenError):
    """Streamed samples are running (``submit``), and the call needs an idle engine (``generate``,
    ``finish_generation``): wait for the rollouts, cancel them, or submit the batch too."""


class OutputError(RollgenError):
    """A backend returned output that breaks the output contract (a bug in the backend, found
    by the core's check of every result)."""
