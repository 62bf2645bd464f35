"""``Backend``: one backend as a plugin registers it (name, lazy factory path, config type,
capabilities). Its own module, so that the hookspecs and the registry both import it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from rollgen.errors import PluginError
from rollgen.spec import Capability

_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")
_FACTORY = re.compile(r"^[\w.]+:[\w.]+$")


@dataclass(frozen=True)
class Backend:
    """One backend, as a plugin registers it. Everything here is light: no engine import."""

    name: str
    factory: str
    config_type: type
    capabilities: frozenset[Capability]
    requires: tuple[str, ...] = ()
    install_hint: str = ""
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise PluginError(f"backend name {self.name!r} must match {_NAME.pattern}")
        if not isinstance(self.factory, str) or not _FACTORY.match(self.factory):
            raise PluginError(f"backend {self.name!r}: factory must be 'module:attribute'")
        if not (isinstance(self.config_type, type) and hasattr(self.config_type, "__required_keys__")):
            raise PluginError(f"backend {self.name!r}: config_type must be a TypedDict class")
        known = {c.value for c in Capability}
        unknown = sorted(str(c) for c in self.capabilities if str(c) not in known)
        if unknown:
            raise PluginError(
                f"backend {self.name!r}: unknown capabilities {unknown}; known: {sorted(known)}"
            )
        object.__setattr__(self, "capabilities", frozenset(Capability(str(c)) for c in self.capabilities))
