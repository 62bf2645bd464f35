"""The requests the server takes, as pydantic models: OpenAI's fields agent code sends, and
rollgen's extensions (``top_k``, ``session_id``, ``request_id``). Fields OpenAI has that rollgen
cannot honour are refused by name (``unsupported``) rather than ignored. Every value is bounded
so that what passes fits the tensors and engines it goes to: anything else is a 400 naming the
field."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollgen.spec import MaxNewTokens, Seed, Temperature, TokenId, TopK, TopP

#: What a session id may hold: it is a path segment of ``/v1/sessions/{id}`` (``.`` and ``..``,
#: which clients resolve away in a URL, are not ids).
SESSION_ID = re.compile(r"(?!\.{1,2}$)[A-Za-z0-9._:@~-]{1,200}")
SESSION_ID_RULE = "1 to 200 of the characters A-Z a-z 0-9 . _ : @ ~ -, other than . or .."
#: The most samples one request asks for.
MAX_N = 128


#: Where a value lies in a request's JSON: None (the whole), or (where its parent lies, its key or
#: index; a key itself as a one-tuple).
Path = tuple[Any, Any] | None


def check_text(value: Any) -> Any:
    """``value`` (a request's parsed JSON) unchanged; ValueError naming the first string in it
    that is not valid Unicode text (a lone surrogate, which JSON's ``\\ud800`` escapes allow and
    no tokenizer takes). Walks the JSON without recursion, once, in time linear in its size (a
    value's path is spelled out only for the string refused)."""
    stack: list[tuple[Path, Any]] = [(None, value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(
                    f"{spelled(path) or 'a string'}: not valid Unicode text (a lone surrogate)"
                ) from None
        elif isinstance(item, dict):
            stack.extend(((path, k), v) for k, v in item.items())
            stack.extend(((path, (k,)), k) for k in item)
        elif isinstance(item, list):
            stack.extend(((path, i), v) for i, v in enumerate(item))
    return value


def spelled(path: Path) -> str:
    """``path`` as ``messages[0].content`` (a key: ``... (a key)``)."""
    steps = []
    while path is not None:
        path, step = path
        steps.append(step)
    where = ""
    for step in reversed(steps):
        if isinstance(step, tuple):
            where += " (a key)"
        elif isinstance(step, int):
            where += f"[{step}]"
        else:
            where += f".{step}" if where else str(step)
    return where


class _Request(BaseModel):
    """What both endpoints share. Unknown fields are kept (OpenAI clients send more than any one
    server reads) and those rollgen knows it cannot honour are named in ``unsupported``."""

    model_config = ConfigDict(extra="allow")

    model: str
    n: int = Field(default=1, ge=1, le=MAX_N)
    max_tokens: MaxNewTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    #: Extension (as vLLM's and SGLang's servers have it): -1 is off.
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    #: Extension: keep this conversation's exact tokens on the server (``/v1/sessions/{id}``).
    session_id: str | None = None
    #: Extension: a name for this request, so that ``POST /v1/rollgen/cancel`` can end it.
    request_id: str | None = Field(default=None, min_length=1, max_length=200)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text(cls, data: Any) -> Any:
        return check_text(data)

    @field_validator("session_id")
    @classmethod
    def _session_id(cls, value: str | None) -> str | None:
        if value is not None and not SESSION_ID.fullmatch(value):
            raise ValueError(f"a session id holds {SESSION_ID_RULE}")
        return value

    @model_validator(mode="after")
    def _seeds(self) -> _Request:
        if self.seed is not None and self.seed + self.n > 2**63:
            raise ValueError(
                f"seed: choice i takes seed + i, so seed + n - 1 must be below 2**63 (n={self.n})"
            )
        return self

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def unsupported(self) -> list[str]:
        """The fields set that the server cannot honour (a 400 names them)."""
        bad = [f for f in ("presence_penalty", "frequency_penalty") if getattr(self, f)]
        if self.logit_bias:
            bad.append("logit_bias")
        return bad


class CompletionRequest(_Request):
    """``POST /v1/completions``: a prompt as text or as token ids (one prompt per request)."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    #: OpenAI's ``logprobs`` of a completion: how many alternatives per token; rollgen has the
    #: sampled token's own logprob only, so 0 (or None) is all it takes.
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.logprobs:
            bad.append(f"logprobs={self.logprobs} (only the sampled token's logprob: logprobs=0)")
        if self.echo:
            bad.append("echo")
        if self.best_of not in (None, 1, self.n):
            bad.append("best_of")
        if self.suffix:
            bad.append("suffix")
        return bad


class ToolFunction(BaseModel):
    """The function an assistant's tool call names, its arguments as JSON text."""

    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str = ""


class ToolCallIn(BaseModel):
    """An assistant message's tool call, as OpenAI's SDK sends it back."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolFunction


class ContentPart(BaseModel):
    """One part of a message's content; text parts are the ones read (extra keys pass through)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message of a conversation, as the chat template takes it (extra keys pass through)."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as a dict for the template; text parts joined into one string."""
        data = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            data["content"] = "".join(p.text or "" for p in self.content if p.type == "text")
        return data


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``: messages rendered by the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxNewTokens | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.top_logprobs:
            bad.append(f"top_logprobs={self.top_logprobs} (only the sampled token's logprob)")
        if isinstance(self.tool_choice, dict) or self.tool_choice == "required":
            bad.append("tool_choice other than 'auto' or 'none'")
        if self.response_format and self.response_format.get("type") != "text":
            bad.append("response_format")
        return bad


class CancelRequest(BaseModel):
    """``POST /v1/rollgen/cancel``: end a request's samples now (they return the tokens they
    have, ``stop_reason`` ``cancelled``)."""

    request_id: Annotated[str, Field(min_length=1, max_length=200)]
