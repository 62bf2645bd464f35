"""The requests the server takes, as pydantic models: OpenAI's fields agent code sends, and
rollgen's extensions (``top_k``, ``session_id``, ``request_id``). Fields OpenAI has that rollgen
cannot honour are refused by name (``unsupported``) rather than ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollgen.spec import MaxNewTokens, Seed, Temperature, TopK, TopP


class _Request(BaseModel):
    """What both endpoints share. Unknown fields are kept (OpenAI clients send more than any one
    server reads) and those rollgen knows it cannot honour are named in ``unsupported``."""

    model_config = ConfigDict(extra="allow")

    model: str
    n: int = Field(default=1, ge=1, le=128)
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
    session_id: str | None = Field(default=None, min_length=1, max_length=200)
    #: Extension: a name for this request, so that ``POST /v1/rollgen/cancel`` can end it.
    request_id: str | None = Field(default=None, min_length=1, max_length=200)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

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

    prompt: str | list[int] | list[str] | list[list[int]]
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


class ChatMessage(BaseModel):
    """One message of a conversation, as the chat template takes it (extra keys pass through)."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as a dict for the template; text parts joined into one string."""
        data = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            data["content"] = "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
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

    request_id: str
