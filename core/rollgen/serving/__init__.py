"""``rollgen serve``: an OpenAI-compatible endpoint over any backend that declares ``async``,
with token-in/token-out sessions and weight versions (docs/serving.md). Needs the ``serve``
extra (``pip install 'rollgen[serve]'``)."""

from rollgen.serving.server import Server, serve
from rollgen.serving.state import Limits
from rollgen.serving.tools import HermesToolParser, ToolCall, ToolParser, tool_parsers

__all__ = ["HermesToolParser", "Limits", "Server", "ToolCall", "ToolParser", "serve", "tool_parsers"]
