"""Tool-call parsers: a model's output text → OpenAI ``tool_calls``. One built in (``hermes``:
the JSON-in-``<tool_call>`` tags of Hermes- and Qwen-style templates); plugins add others
through the ``rollgen_register_tool_parsers`` hook."""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from rollgen.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def openai(self, index: int) -> dict[str, object]:
        return {
            "index": index,
            "id": self.id or f"call_{secrets.token_hex(12)}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class ToolParser(Protocol):
    """Reads tool calls out of a model's text; returns the text left over and the calls."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]: ...


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen 2.5/3).
    A block that is not such JSON stays in the text. Linear in the text: a model's output is
    what an RL policy can learn to make, so a parser must not be super-linear in it (each block
    is the text from an opening tag to the first closing tag after it, read once)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall] = []
        kept: list[str] = []
        at = 0
        while (start := text.find(self.OPEN, at)) >= 0:
            end = text.find(self.CLOSE, start + len(self.OPEN))
            if end < 0:  # no closing tag after this one: none after any later one either
                break
            call = _call(text[start + len(self.OPEN) : end])
            kept.append(text[at:start])
            if call is None:
                kept.append(text[start : end + len(self.CLOSE)])
            else:
                calls.append(call)
            at = end + len(self.CLOSE)
        if not calls:
            return text, []
        kept.append(text[at:])
        return "".join(kept).strip(), calls


def _call(block: str) -> ToolCall | None:
    """The call a block's JSON names; None for anything else (too deeply nested JSON too)."""
    try:
        data = json.loads(block.strip())
    except (ValueError, RecursionError):
        return None
    if not (isinstance(data, dict) and isinstance(data.get("name"), str)):
        return None
    args = data.get("arguments", {})
    return ToolCall(data["name"], args if isinstance(args, str) else json.dumps(args))


BUILT_IN: dict[str, Callable[[], ToolParser]] = {"hermes": HermesToolParser}


def tool_parsers() -> dict[str, Callable[[], ToolParser]]:
    """Every parser by name: the built-in ones, then the plugins' (a plugin's name that is taken
    already is refused with a warning)."""
    from rollgen.registry import get_registry

    found = dict(BUILT_IN)

    def register(name: str, factory: Callable[[], ToolParser]) -> None:
        if name in found:
            logger.warning("tool parser %r is registered twice; keeping the first", name)
            return
        found[name] = factory

    get_registry().pm.hook.rollgen_register_tool_parsers(register=register)
    return found


def choose_tool_parser(name: str | None, chat_template: str | None) -> ToolParser | None:
    """The parser named ``name``; ``"auto"``: ``hermes`` where the chat template writes
    ``<tool_call>`` tags, else none; None: none (tool calls stay in the text)."""
    if name is None:
        return None
    if name == "auto":
        return HermesToolParser() if chat_template and "<tool_call>" in chat_template else None
    parsers = tool_parsers()
    if name not in parsers:
        raise ConfigError(f"tool_parser {name!r} is not registered; known: {sorted(parsers)} or 'auto'")
    return parsers[name]()
