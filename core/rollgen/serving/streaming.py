"""Token streaming (``stream: true``): each choice's tokens as the engine makes them, as OpenAI
chunks whose ``rollgen`` field carries the new token ids, their logprobs and weight-version
spans, as the whole answer's does. The text is decoded incrementally, each new token with a
few before it (linear in the reply, on the event loop); text that may begin a stop string is
held back until the choice ends, and with tools offered the whole text is (the tool parser
reads the reply whole, on a worker thread)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rollgen.rollout import SampleResult, TokenDelta

#: Tokens decoded before a token's own to read its text (a character's bytes span at most 4).
WINDOW = 6
#: Tokens that may wait for a whole character before their text is sent as it decodes.
MAX_PENDING = 8


class IncrementalText:
    """A sample's text, decoded as its tokens come, for any tokenizer: each call decodes the new
    tokens with at most ``WINDOW`` before them, and holds back tokens that end inside a
    character (up to ``MAX_PENDING`` of them). Fast tokenizers use ``StreamedText`` instead."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._read = 0  # tokens whose text was given

    def add(self, ids: Sequence[int]) -> str:
        """The text that ``ids`` (the next tokens) add: up to the last token that ends a
        character (holding back at most ``MAX_PENDING`` tokens: bytes that never make one are
        given as they decode)."""
        self._ids.extend(ids)
        start = max(0, self._read - WINDOW)
        before = self._decode(self._ids[start : self._read])
        end = len(self._ids)
        text = self._decode(self._ids[start:end])
        while text.endswith("\ufffd") and len(self._ids) - end < MAX_PENDING:
            end -= 1  # hold this token back
            if end == self._read:
                return ""
            text = self._decode(self._ids[start:end])
        self._read = end
        return text[len(before) :]


class StreamedText:
    """The same for a fast tokenizer, by its own incremental decoder (``tokenizers``'
    ``DecodeStream``, special tokens skipped): a token at a time, in Rust."""

    def __init__(self, backend: Any) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=True)

    def add(self, ids: Sequence[int]) -> str:
        pieces = (self._stream.step(self._backend, t) for t in ids)
        return "".join(p for p in pieces if p)


class ChoiceStream:
    """One streamed choice: its chunks from its deltas, then its last from its result.

    Args:
        index: the choice's index. prompt: its prompt's token ids (in its first chunk).
        text: its text's incremental decoder (``ServedGeneration.text_stream``).
        hold: characters of text held back while it runs (the longest stop string, less one);
            None: all of it (tools offered: the parser reads the reply whole).
        chat: chat chunks (``delta``) or completion chunks (``text``).
        logprobs: OpenAI's ``logprobs`` field asked for.
        token_text: a token's own text (for OpenAI's ``logprobs``)."""

    def __init__(
        self,
        index: int,
        prompt: Sequence[int],
        text: IncrementalText | StreamedText,
        hold: int | None,
        chat: bool,
        logprobs: bool,
        token_text: Callable[[int], str],
        logprobs_mode: str,
    ) -> None:
        self.index, self.prompt, self.hold, self.chat = index, prompt, hold, chat
        self.logprobs, self.token_text, self.logprobs_mode = logprobs, token_text, logprobs_mode
        self.text = text
        # the text decoded so far, in pieces (joined once each: linear in the reply): sent, held
        self._sent: list[str] = []
        self._held: list[str] = []
        self._held_chars = 0
        self.sent = 0  # characters sent
        self.started = False

    def delta(self, delta: TokenDelta) -> dict[str, Any]:
        """The chunk choice for ``delta``'s tokens."""
        piece = self.text.add(delta.token_ids)
        if piece:
            self._held.append(piece)
            self._held_chars += len(piece)
        text = ""
        # a sample's last tokens may complete a stop string: its end says what text they add
        if self.hold is not None and not delta.final and self._held_chars > self.hold:
            held = "".join(self._held)  # at most ``hold`` characters and this delta's
            cut = len(held) - self.hold
            text, rest = held[:cut], held[cut:]
            self._held, self._held_chars = ([rest] if rest else []), len(rest)
            self._sent.append(text)
            self.sent += cut
        extension = {
            "token_ids": list(delta.token_ids),
            "logprobs": list(delta.logprobs),
            "versions": [
                {"version": delta.version, "start": delta.start, "end": delta.start + len(delta.token_ids)}
            ],
        }
        return self._chunk(text, extension, None, delta.token_ids, delta.logprobs)

    def end(self, result: SampleResult, final: dict[str, Any]) -> dict[str, Any]:
        """The last chunk choice: ``final`` is the whole answer's choice (``responses``), from
        which the text not sent yet, the finish reason and any tool calls are taken."""
        extension: dict[str, Any] = {
            "token_ids": [],
            "logprobs": [],
            "versions": [],
            "stop_reason": result.stop_reason,
            "replica": result.replica,
        }
        whole = (final["message"].get("content") or "") if self.chat else final["text"]
        # the text sent is a prefix of the whole (held back where a stop string may begin)
        rest = whole[self.sent :] if whole.startswith("".join(self._sent)) else ""
        chunk = self._chunk(rest, extension, final["finish_reason"], (), ())
        if self.chat and final["message"].get("tool_calls"):
            chunk["delta"]["tool_calls"] = final["message"]["tool_calls"]
        return chunk

    def _chunk(
        self,
        text: str,
        extension: dict[str, Any],
        finish: str | None,
        tokens: Sequence[int],
        logprobs: Sequence[float],
    ) -> dict[str, Any]:
        first, self.started = not self.started, True
        if first:
            extension = {
                **extension,
                "prompt_token_ids": list(self.prompt),
                "logprobs_mode": self.logprobs_mode,
            }
        chunk: dict[str, Any] = {"index": self.index, "finish_reason": finish, "logprobs": None}
        if self.chat:
            chunk["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            chunk["text"] = text
        if self.logprobs and tokens:
            chunk["logprobs"] = self._openai_logprobs(tokens, logprobs)
        chunk["rollgen"] = extension
        return chunk

    def _openai_logprobs(self, tokens: Sequence[int], logprobs: Sequence[float]) -> dict[str, Any]:
        texts = [self.token_text(t) for t in tokens]
        if self.chat:
            return {
                "content": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, lp in zip(texts, logprobs)
                ]
            }
        return {"tokens": texts, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": None}
