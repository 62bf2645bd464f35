"""The ``rollgen`` command: backends, generate, demo, tiny-model, serve, conformance.

A rollgen error (``RollgenError``: an unknown backend, a bad config, ...) ends a command with its
message alone on stderr and exit status 1; ``rollgen --debug ...`` or ``ROLLGEN_DEBUG=1`` shows
its traceback too.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from rollgen.errors import ConfigError, RollgenError

if TYPE_CHECKING:
    from rollgen.registry import PluginRecord, RegisteredBackend

logger = logging.getLogger(__name__)


class _Commands(TyperGroup):
    """The commands, answering rollgen errors in one line unless ``--debug``."""

    # typer.Context: the public name of the (vendored, private) click context typer passes here
    def invoke(self, ctx: typer.Context) -> Any:  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except RollgenError as exc:
            if ctx.params.get("debug"):
                raise
            logger.error("%s", exc)
            raise typer.Exit(1) from None


app = typer.Typer(
    cls=_Commands, help="rollgen: rollout generation for RL post-training.", no_args_is_help=True
)
console = Console()


@app.callback()
def _options(
    debug: bool = typer.Option(
        False, "--debug", envvar="ROLLGEN_DEBUG", help="show the traceback of rollgen's errors"
    ),
) -> None:
    """rollgen: rollout generation for RL post-training."""


def _row(
    name: str, entry: RegisteredBackend | None, plugin: PluginRecord, status: str, reason: str | None
) -> dict[str, Any]:
    return {
        "name": name,
        "plugin": plugin.name,
        "distribution": plugin.distribution,
        "version": plugin.version,
        "capabilities": sorted(c.value for c in entry.backend.capabilities) if entry else [],
        "importable": status == "ok",
        "status": status,
        "reason": reason,
        "description": entry.backend.description if entry else "",
    }


def _backend_rows() -> list[dict[str, Any]]:
    """One row per backend, per conflicting registration of a name, per plugin not loaded."""
    from rollgen.registry import get_registry

    reg = get_registry()
    rows = []
    for name, entry in sorted(reg.backends.items()):
        reason = entry.unavailable_reason()
        rows.append(_row(name, entry, entry.plugin, "unavailable" if reason else "ok", reason))
    for name, entries in sorted(reg.conflicts.items()):
        rows.extend(_row(name, e, e.plugin, "conflict", str(reg.conflict_error(name))) for e in entries)
    for plugin in reg.plugins.values():
        if plugin.status != "ok":
            reason = str(plugin.error) if plugin.error else "disabled by environment"
            rows.append(_row(plugin.name, None, plugin, plugin.status, reason))
    return rows


@app.command()
def backends(as_json: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """List installed backends: distribution, version, capabilities, importable or why not."""
    rows = _backend_rows()
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="rollgen backends")
    for col in ("name", "distribution", "version", "status", "capabilities / reason"):
        table.add_column(col)
    for r in rows:
        detail = ", ".join(r["capabilities"]) if r["status"] == "ok" else (r["reason"] or "")
        style = "green" if r["status"] == "ok" else "yellow"
        table.add_row(
            r["name"],
            r["distribution"] or "-",
            r["version"] or "-",
            f"[{style}]{r['status']}[/]",
            escape(detail),
        )
    console.print(table)


def _config(backend: str, model: str | None, max_new_tokens: int, extra: str | None) -> dict[str, Any]:
    """The tiny model's config (or ``model``'s), with the ``--config`` JSON merged in. An unknown
    backend or a ``--config`` that is not a JSON object raise before the tiny model is built."""
    from rollgen.config import deep_merge
    from rollgen.registry import get_registry
    from rollgen.testing.config import tiny_config

    get_registry().get(backend)
    try:
        overrides = json.loads(extra) if extra else {}
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--config is not valid JSON: {exc}") from exc
    if not isinstance(overrides, dict):
        raise ConfigError(f"--config must be a JSON object, got {extra!r}")
    return deep_merge(tiny_config(backend, model, max_new_tokens=max_new_tokens), overrides)


@app.command()
def generate(
    prompts: list[str] = typer.Argument(..., help="prompts to continue"),
    backend: str = typer.Option("hf", help="backend name"),
    model: str | None = typer.Option(None, help="local model folder (default: the tiny model)"),
    max_new_tokens: int = typer.Option(16),
    greedy: bool = typer.Option(True, help="greedy decoding (else sampling)"),
    config: str | None = typer.Option(None, help="JSON merged into the config"),
) -> None:
    """Generate text continuations with any backend."""
    import rollgen

    with rollgen.create_generation(_config(backend, model, max_new_tokens, config)) as gen:
        texts = gen.generate_text({"prompts": list(prompts)}, greedy=greedy)["texts"]
    for p, t in zip(prompts, texts):
        console.print(f"[bold]{p}[/]{t}")


@app.command()
def demo(
    backend: str = typer.Option("hf", help="backend name"),
    config: str | None = typer.Option(None, help="JSON merged into the config"),
    agent: bool = typer.Option(
        False,
        "--agent",
        help="the agentic demo: tool-using episodes through rollgen serve and the openai SDK",
    ),
    steps: int | None = typer.Option(None, min=1, help="RL steps (default: the demo's)"),
) -> None:
    """The main job on the embedded tiny model: a few RL steps (generate → reward → update →
    refit → generate) where the reward rises and engine and trainer logprobs agree. With
    ``--agent``: the same through ``rollgen serve``, with agent code on the openai SDK calling a
    tool over multi-turn sessions, and the reward for correct tool use rising (docs/agent-demo.md)."""
    if agent:
        from rollgen.agent_demo import AgentDemoSettings, run_agent_demo
        from rollgen.testing.tiny_model import tiny_model_dir

        settings = AgentDemoSettings(**({"steps": steps} if steps else {}))
        cfg = _config(backend, tiny_model_dir(agent=True), settings.max_tokens, config)
        run_agent_demo(backend, cfg, console, settings)
        return
    from rollgen.demo import DemoSettings, run_demo

    run_demo(
        backend,
        _config(backend, None, 12, config),
        console,
        DemoSettings(**({"steps": steps} if steps else {})),
    )


@app.command("tiny-model")
def tiny_model(
    agent: bool = typer.Option(
        False, "--agent", help="the agent variant: 2,048 positions, a chat template with tools"
    ),
) -> None:
    """Print the folder of the embedded tiny model (built on first use, then cached under
    ROLLGEN_CACHE_DIR): a local Hugging Face model folder for any config's ``model_name``."""
    from rollgen.testing.tiny_model import tiny_model_dir

    typer.echo(tiny_model_dir(agent=agent))


def read_config(source: str) -> dict[str, Any]:
    """A generation config from a JSON file's path, or given as JSON text."""
    from pathlib import Path

    try:
        text = source if source.lstrip().startswith("{") else Path(source).read_text()
    except OSError as exc:
        raise ConfigError(f"the config {source!r} is neither JSON text nor a readable file: {exc}") from exc
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"the config ({source!r}) is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"the config must be a JSON object, got {type(config).__name__}")
    return config


@app.command()
def serve(
    config: str = typer.Argument(..., help="a JSON file, or JSON text: create_generation's keys"),
    host: str = typer.Option("127.0.0.1", help="address to listen on (a loopback one by default)"),
    port: int = typer.Option(8000, help="port (0: a free one)"),
    api_key: str | None = typer.Option(
        None, envvar="ROLLGEN_API_KEY", help="the key clients send (default: one generated, printed once)"
    ),
    no_auth: bool = typer.Option(False, "--no-auth", help="no API key (loopback hosts only)"),
    model_id: str | None = typer.Option(None, help="the model name clients pass (default: its folder's)"),
    tool_parser: str = typer.Option("auto", help="tool-call parser: a registered name, auto or none"),
) -> None:
    """Serve an OpenAI-compatible endpoint over a generation (docs/serving.md) until interrupted."""
    import threading

    import rollgen
    from rollgen.serving import Server

    with rollgen.create_generation(read_config(config)) as gen:
        server = Server(
            gen,
            host,
            port,
            api_key,
            require_api_key=not no_auth,
            model_id=model_id,
            tool_parser=None if tool_parser == "none" else tool_parser,
        )
        with server:
            typer.echo(f"serving {server.model_id} at {server.url}")
            if server.generated_key:
                typer.echo(f"api key (generated, shown once): {server.api_key}")
            try:
                threading.Event().wait()
            except KeyboardInterrupt:
                logger.info("interrupted: stopping the server")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def conformance(
    ctx: typer.Context,
    backend: str = typer.Argument(..., help="backend name"),
    report: str | None = typer.Option(None, help="write the JSON report here"),
    config: str | None = typer.Option(None, help="JSON merged into the suite's config"),
    allow_unavailable: bool = typer.Option(
        False, help="report the tests skipped (not a failed run) when BACKEND cannot run here"
    ),
) -> None:
    """Run the conformance suite against BACKEND (extra args go to pytest)."""
    import pytest

    args = [
        "-p",
        "rollgen.conformance",
        "--pyargs",
        "rollgen.conformance.suite",
        f"--rollgen-backend={backend}",
        "-p",
        "no:cacheprovider",
    ]
    if report:
        args.append(f"--rollgen-report={report}")
    if config:
        args.append(f"--rollgen-config={config}")
    if allow_unavailable:
        args.append("--rollgen-allow-unavailable")
    raise typer.Exit(pytest.main(args + list(ctx.args)))


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    main()
