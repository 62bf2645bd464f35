"""Backend registry: entry-point discovery, registration checks, lazy engine loading.

Environment (the one place these are defined):
- ``ROLLGEN_PLUGINS``: comma-separated entry-point names; when set, only these plugins load.
- ``ROLLGEN_DISABLE_PLUGINS``: comma-separated entry-point names that never load.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from types import ModuleType
from typing import Any

import pluggy

from rollgen import hookspecs
from rollgen.backend import Backend
from rollgen.errors import BackendNotFound, BackendUnavailable, PluginError

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "rollgen"
ALLOW_ENV = "ROLLGEN_PLUGINS"
BLOCK_ENV = "ROLLGEN_DISABLE_PLUGINS"


@dataclass
class PluginRecord:
    """One discovered plugin (an entry point) and how its loading went."""

    name: str
    distribution: str | None
    version: str | None
    status: str = "ok"  # ok | broken | disabled
    error: BaseException | None = None
    backends: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """``plugin 'name' (distribution version)``, for error messages."""
        origin = " ".join(x for x in (self.distribution, self.version) if x) or "no distribution"
        return f"plugin {self.name!r} ({origin})"


@dataclass(frozen=True)
class RegisteredBackend:
    backend: Backend
    plugin: PluginRecord

    def missing_requirements(self) -> list[str]:
        """Import names the engine needs that are not installed (checked without importing)."""
        return [m for m in self.backend.requires if importlib.util.find_spec(m) is None]

    @property
    def available(self) -> bool:
        return not self.missing_requirements()

    def unavailable_reason(self) -> str | None:
        missing = self.missing_requirements()
        if not missing:
            return None
        hint = f"; install it with: {self.backend.install_hint}" if self.backend.install_hint else ""
        return f"engine not importable (missing {', '.join(missing)}){hint}"

    def load_factory(self) -> Callable[..., Any]:
        """Import the backend's factory; BackendUnavailable (cause chained) when that fails."""
        reason = self.unavailable_reason()
        if reason:
            raise BackendUnavailable(f"backend {self.backend.name!r}: {reason}")
        module_name, _, attr = self.backend.factory.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise BackendUnavailable(
                f"backend {self.backend.name!r} (plugin {self.plugin.name!r}) could not import "
                f"its engine from {self.backend.factory!r}: {exc}. {self.backend.install_hint}"
            ) from exc
        return obj


def _env_list(env: Mapping[str, str], key: str) -> set[str] | None:
    raw = env.get(key)
    if raw is None:
        return None
    return {x.strip() for x in raw.split(",") if x.strip()}


class Registry:
    """Loads plugins, collects their backends, keeps broken plugins apart."""

    def __init__(
        self,
        eps: Iterable[EntryPoint] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginRecord] = {}
        self.backends: dict[str, RegisteredBackend] = {}
        #: Backend names registered by more than one plugin: usable from none of them.
        self.conflicts: dict[str, list[RegisteredBackend]] = {}
        env = os.environ if env is None else env
        allow, block = _env_list(env, ALLOW_ENV), _env_list(env, BLOCK_ENV)
        for ep in entry_points(group=ENTRY_POINT_GROUP) if eps is None else eps:
            dist = getattr(ep, "dist", None)
            record = PluginRecord(ep.name, dist.name if dist else None, dist.version if dist else None)
            if ep.name in self.plugins:
                logger.warning("plugin %r is provided twice; keeping the first", ep.name)
                continue
            self.plugins[ep.name] = record
            if (allow is not None and ep.name not in allow) or (block and ep.name in block):
                record.status = "disabled"
                continue
            try:
                module = ep.load()
            except Exception as exc:  # noqa: BLE001 - a broken plugin is recorded, never fatal
                self._broken(record, exc)
                continue
            self.add_plugin(module, record)

    def add_plugin(self, plugin: ModuleType | object, record: PluginRecord) -> None:
        """Register a plugin object (module or instance with hookimpls) and its backends."""
        self.plugins.setdefault(record.name, record)
        try:
            self.pm.register(plugin, name=record.name)
            self.pm.check_pending()
        except (ValueError, pluggy.PluginValidationError) as exc:
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            self._broken(record, exc)
            return
        impls = [
            i for i in self.pm.hook.rollgen_register_backends.get_hookimpls() if i.plugin_name == record.name
        ]
        pending: list[Backend] = []
        try:
            for impl in impls:
                impl.function(register=pending.append)
            seen: set[str] = set()
            for backend in pending:
                if not isinstance(backend, Backend):
                    raise PluginError(f"register() takes a rollgen.Backend, got {backend!r}")
                if backend.name in seen:
                    raise PluginError(f"backend {backend.name!r} is registered twice")
                seen.add(backend.name)
        except Exception as exc:  # noqa: BLE001 - isolate a faulty plugin, keep the others
            self.pm.unregister(plugin)
            self._broken(record, exc)
            return
        for backend in pending:
            self._add_backend(RegisteredBackend(backend, record))
            record.backends.append(backend.name)

    def _add_backend(self, entry: RegisteredBackend) -> None:
        """Keep ``entry``, unless another plugin registered its name: then neither is used."""
        name = entry.backend.name
        if name in self.backends:
            self.conflicts[name] = [self.backends.pop(name)]
        if name in self.conflicts:
            self.conflicts[name].append(entry)
            logger.warning("%s", self.conflict_error(name))
        else:
            self.backends[name] = entry

    def conflict_error(self, name: str) -> PluginError:
        """The error for backend ``name``, registered by several plugins (each one named)."""
        owners = " and ".join(e.plugin.describe() for e in self.conflicts[name])
        return PluginError(
            f"backend {name!r} is registered by {owners}, so rollgen uses neither: uninstall one "
            f"of these distributions, or disable one plugin with {BLOCK_ENV}=<plugin name>"
        )

    def _broken(self, record: PluginRecord, exc: BaseException) -> None:
        record.status, record.error = "broken", exc
        logger.warning("rollgen plugin %r failed to load: %s", record.name, exc)

    def get(self, name: str) -> RegisteredBackend:
        """The backend called ``name``. BackendNotFound when none is; PluginError when two
        plugins registered it; BackendUnavailable when the plugin of that name is broken."""
        if name in self.backends:
            return self.backends[name]
        if name in self.conflicts:
            raise self.conflict_error(name)
        if name in self.plugins and self.plugins[name].status == "broken":
            record = self.plugins[name]
            raise BackendUnavailable(f"{record.describe()} is broken: {record.error}") from record.error
        installed = ", ".join(sorted(self.backends)) or "none"
        close = difflib.get_close_matches(name, list(self.backends), n=1)
        guess = f" Did you mean {close[0]!r}?" if close else ""
        broken = [p.name for p in self.plugins.values() if p.status == "broken"]
        disabled = [p.name for p in self.plugins.values() if p.status == "disabled"]
        extra = f"; broken plugins: {', '.join(broken)}" if broken else ""
        extra += f"; disabled by {ALLOW_ENV}/{BLOCK_ENV}: {', '.join(disabled)}" if disabled else ""
        raise BackendNotFound(
            f"no rollgen backend named {name!r}.{guess} Installed: {installed}{extra}. A backend is a "
            "distribution with an entry point in group 'rollgen'; rollgen's own come with its extras "
            "(pip install 'rollgen[hf]', 'rollgen[vllm]', 'rollgen[sglang]')"
        )

    def backend_hook(self, name: str, hook: str, **kwargs: Any) -> Any:
        """Call ``hook`` (with ``backend=name``) on the plugin that registered backend ``name``
        and on no other; its answer, or None where that plugin does not implement the hook."""
        owner = self.get(name).plugin.name
        others = [p for n, p in self.pm.list_name_plugin() if n != owner]
        answers = self.pm.subset_hook_caller(hook, remove_plugins=others)(backend=name, **kwargs)
        return answers[0] if answers else None


_registry: Registry | None = None


def get_registry(refresh: bool = False) -> Registry:
    """The process-wide registry, discovered once (``refresh=True`` rediscovers)."""
    global _registry
    if _registry is None or refresh:
        _registry = Registry()
    return _registry
