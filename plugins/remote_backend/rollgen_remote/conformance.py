"""The server the conformance suite holds the remote backend to: a ``rollgen serve`` in a
process of its own (the suite's requests cross a real socket), one per test process."""

from __future__ import annotations

import atexit
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Mapping
from typing import IO, Any, cast

from rollgen.errors import BackendUnavailable

#: Which backend the suite's server runs (``ROLLGEN_REMOTE_BACKEND``, default ``hf``).
BACKEND_ENV = "ROLLGEN_REMOTE_BACKEND"
#: A server to use instead of starting one (with ``ROLLGEN_API_KEY``).
URL_ENV = "ROLLGEN_REMOTE_URL"

KNOWN_FAILURES = {
    "test_broken_model_folders_are_config_errors": (
        "a remote client reads no weights (the server loaded its own): its model folder's weights "
        "are not checked"
    ),
}

_started: dict[str, tuple[str, str]] = {}


def suite_server(base: Mapping[str, Any]) -> tuple[str, str]:
    """``(url, api_key)`` of the suite's server, started on first use over ``base``'s model."""
    if os.environ.get(URL_ENV):
        return os.environ[URL_ENV], os.environ.get("ROLLGEN_API_KEY", "")
    if "server" in _started:
        return _started["server"]
    config = {k: v for k, v in base.items() if k not in ("seed", "remote_cfg")}
    config["backend"] = os.environ.get(BACKEND_ENV, "hf")
    key = secrets.token_urlsafe(32)
    process = subprocess.Popen(
        [sys.executable, "-m", "rollgen.cli", "serve", json.dumps(config), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "ROLLGEN_API_KEY": key},
    )
    atexit.register(_stop, process)
    for line in cast(IO[str], process.stdout):  # ends where the server process ends
        if line.startswith("serving "):
            _started["server"] = (line.rsplit(" at ", 1)[1].strip(), key)
            return _started["server"]
    raise BackendUnavailable(
        f"the suite's rollgen serve over {config['backend']!r} exited ({process.wait()})"
    )


def _stop(process: subprocess.Popen[str]) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
