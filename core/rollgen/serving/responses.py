"""OpenAI response bodies from rollout results, each choice with rollgen's token-in/token-out
extension (``choice["rollgen"]``): the prompt's and the generated token ids, per-token logprobs
(labelled raw or processed), the weight-version spans of the generated tokens, and rollgen's own
stop reason next to OpenAI's ``finish_reason``."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from rollgen.rollout import SampleResult
from rollgen.serving.engine import ServedGeneration
from rollgen.serving.sessions import version_spans
from rollgen.serving.tools import ToolParser

#: rollgen's stop reasons (``rollgen.output.STOP_REASONS``) as OpenAI's ``finish_reason``.
FINISH_REASONS = {
    "eos": "stop",
    "stop_token": "stop",
    "stop_string": "stop",
    "length": "length",
    "context": "length",
    "aborted": "abort",
    "cancelled": "abort",
}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def extension(served: ServedGeneration, prompt: Sequence[int], result: SampleResult) -> dict[str, Any]:
    """A choice's ``rollgen`` field."""
    versions = [result.version_at(i) for i in range(len(result.token_ids))]
    return {
        "stop_reason": result.stop_reason,
        "prompt_token_ids": list(prompt),
        "token_ids": list(result.token_ids),
        "logprobs": list(result.logprobs),
        "logprobs_mode": served.logprobs_mode,
        "versions": version_spans(versions),
        "replica": result.replica,
    }


def visible_text(served: ServedGeneration, result: SampleResult, stops: Sequence[str]) -> str:
    """The generated text as OpenAI returns it: up to (not including) the stop string hit."""
    text = served.decode(result.token_ids)
    if result.stop_reason == "stop_string":
        cuts = [text.find(s) for s in stops if s in text]
        text = text[: min(cuts)] if cuts else text
    return text


def completion_choice(
    served: ServedGeneration,
    prompt: Sequence[int],
    result: SampleResult,
    stops: Sequence[str],
    logprobs: bool,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": result.index,
        "text": visible_text(served, result, stops),
        "finish_reason": FINISH_REASONS[result.stop_reason],
        "logprobs": None,
        "rollgen": extension(served, prompt, result),
    }
    if logprobs:
        tokens = [served.token_text(t) for t in result.token_ids]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        choice["logprobs"] = {
            "tokens": tokens,
            "token_logprobs": list(result.logprobs),
            "top_logprobs": None,
            "text_offset": offsets,
        }
    return choice


def chat_choice(
    served: ServedGeneration,
    prompt: Sequence[int],
    result: SampleResult,
    stops: Sequence[str],
    logprobs: bool,
    parser: ToolParser | None,
) -> dict[str, Any]:
    text = visible_text(served, result, stops)
    content, calls = parser.parse(text) if parser is not None else (text, [])
    finish = FINISH_REASONS[result.stop_reason]
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    if calls:
        message["tool_calls"] = [c.openai(i) for i, c in enumerate(calls)]
        finish = "tool_calls" if finish == "stop" else finish
    choice: dict[str, Any] = {
        "index": result.index,
        "message": message,
        "finish_reason": finish,
        "logprobs": None,
        "rollgen": extension(served, prompt, result),
    }
    if logprobs:
        choice["logprobs"] = {
            "content": [
                {
                    "token": (t := served.token_text(tok)),
                    "logprob": lp,
                    "bytes": list(t.encode()),
                    "top_logprobs": [],
                }
                for tok, lp in zip(result.token_ids, result.logprobs)
            ]
        }
    return choice


def body(
    kind: str, response_id: str, model: str, choices: list[dict[str, Any]], prompt_tokens: int | None
) -> dict[str, Any]:
    """A response (``kind``: ``text_completion``, ``chat.completion`` or a chunk object)."""
    out: dict[str, Any] = {
        "id": response_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if prompt_tokens is not None:
        out["usage"] = usage(prompt_tokens, choices)
    return out


def usage(prompt_tokens: int, choices: list[dict[str, Any]]) -> dict[str, int]:
    return usage_counts(prompt_tokens, sum(len(c["rollgen"]["token_ids"]) for c in choices))


def usage_counts(prompt_tokens: int, generated: int) -> dict[str, int]:
    """OpenAI's ``usage`` (a request's prompt counted once, whatever its ``n``)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": prompt_tokens + generated,
    }
