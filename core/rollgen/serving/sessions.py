"""Sessions: a conversation's exact tokens, kept on the server. Each turn's prompt is the
session's tokens so far (what the engine saw and produced, never retokenized) plus the new
messages alone, rendered by the chat template; the trainer reads the whole history back with
per-token logprobs, weight versions and a loss mask (generated or environment token)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollgen.errors import InputError
from rollgen.rollout import SampleResult

#: ``render(messages, add_generation_prompt)``: the chat template's text.
Render = Callable[[list[dict[str, Any]], bool], str]


@dataclass
class Session:
    """One conversation's history: every token with its logprob (None for environment tokens:
    prompts, tool results), its weight version (None likewise) and whether it was generated."""

    id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    generated: list[bool] = field(default_factory=list)
    #: Chat sessions: the messages so far (the assistant's as it generated them) and their text.
    messages: list[dict[str, Any]] = field(default_factory=list)
    text: str = ""
    #: The template's text after the last reply's generated tokens (its end-of-turn markup that
    #: the engine did not produce), which the next turn's prompt starts with.
    bridge: str = ""
    #: Why the next chat turn cannot extend this session (a template that rewrites replies).
    broken: str | None = None
    #: ``chat`` or ``completion``, set by the first turn (a session is one or the other).
    kind: str | None = None
    #: The data-parallel replica that served the last turn (it holds the prefix in its cache):
    #: the next turn prefers it.
    replica: int | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def add_environment(self, ids: Sequence[int]) -> None:
        self.token_ids.extend(ids)
        self.logprobs.extend([None] * len(ids))
        self.versions.extend([None] * len(ids))
        self.generated.extend([False] * len(ids))

    def add_generated(self, result: SampleResult) -> None:
        self.token_ids.extend(result.token_ids)
        self.logprobs.extend(result.logprobs)
        self.versions.extend(result.version_at(i) for i in range(len(result.token_ids)))
        self.generated.extend([True] * len(result.token_ids))
        self.replica = result.replica if result.replica is not None else self.replica

    def check_kind(self, kind: str) -> None:
        if self.kind not in (None, kind):
            raise InputError(f"session {self.id!r} is a {self.kind} session; it cannot take a {kind} turn")
        self.kind = kind

    def view(self) -> dict[str, Any]:
        """What ``GET /v1/sessions/{id}`` returns."""
        return {
            "id": self.id,
            "object": "rollgen.session",
            "token_ids": self.token_ids,
            "logprobs": self.logprobs,
            "loss_mask": [int(g) for g in self.generated],
            "versions": version_spans(self.versions),
            "messages": self.messages,
        }

    # ---- chat turns -------------------------------------------------------------------------
    def chat_prompt(
        self, messages: list[dict[str, Any]], render: Render
    ) -> tuple[str, str, list[dict[str, Any]]]:
        """This turn's new text to tokenize, the whole conversation's text, and the new
        messages. On the first turn the new text is the whole conversation; after it, only what
        the new messages add (the history must be the session's, the assistant's replies
        counted as the server generated them). Changes nothing: ``commit_chat`` does."""
        if not self.messages:
            full = render(messages, True)
            return full, full, messages
        if self.broken:
            raise InputError(f"session {self.id!r} cannot take another turn: {self.broken}")
        known = len(self.messages)
        if len(messages) <= known:
            raise InputError(
                f"session {self.id!r} holds {known} messages; a turn sends them all, then new ones"
            )
        for i, (mine, theirs) in enumerate(zip(self.messages, messages)):
            if mine["role"] != theirs["role"] or (
                mine["role"] != "assistant" and mine.get("content") != theirs.get("content")
            ):
                raise InputError(
                    f"session {self.id!r}: message {i} is not the one the session holds (a session's "
                    "history cannot change; start a new session to branch)"
                )
        new = messages[known:]
        full = render(self.messages + new, True)
        if not full.startswith(self.text):
            raise InputError(
                f"session {self.id!r}: the chat template renders this turn's history differently from "
                "the last turn's (did `tools` change?); a session's turns must extend it"
            )
        return self.bridge + full[len(self.text) :], full, new

    def commit_chat(
        self,
        new: list[dict[str, Any]],
        new_ids: Sequence[int],
        full: str,
        result: SampleResult,
        reply: str,
        ended: str,
        render: Render,
    ) -> None:
        """Record a turn: its new messages and tokens, then the assistant's reply (``reply``: its
        text; ``ended``: the text of the stop token it ended on, or '') and what the template
        puts after the reply (the next turn's prompt starts with that)."""
        self.messages.extend(new)
        self.add_environment(new_ids)
        self.add_generated(result)
        self.messages.append({"role": "assistant", "content": reply})
        self.text = render(self.messages, False)
        head = full + reply
        if not self.text.startswith(head):
            self.broken = "the chat template does not render the assistant's reply as it was generated"
            return
        tail = self.text[len(head) :]
        self.bridge = tail[len(ended) :] if ended and tail.startswith(ended) else tail


def version_spans(versions: Sequence[int | None]) -> list[dict[str, int]]:
    """Runs of generated tokens made by one weight version: ``{version, start, end}`` (token
    positions, ``end`` exclusive), environment tokens left out."""
    spans: list[dict[str, int]] = []
    for i, v in enumerate(versions):
        if v is None:
            continue
        if spans and spans[-1]["version"] == v and spans[-1]["end"] == i:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


class Sessions:
    """Every live session, by id, up to ``limit`` of them. A session is made by its first turn
    (``open``) and kept only once a turn of it is recorded: a first turn that fails leaves
    nothing behind (``discard``), and until one is recorded the session is not listed."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._by_id: dict[str, Session] = {}

    def open(self, session_id: str) -> Session:
        """The session ``session_id``, made (unrecorded) if there is none; SessionLimit when
        ``limit`` sessions are open."""
        found = self._by_id.get(session_id)
        if found is not None:
            return found
        if len(self._by_id) >= self.limit:
            raise SessionLimit(
                f"{self.limit} sessions are open (max_sessions); DELETE /v1/sessions/{{id}} the finished ones"
            )
        session = self._by_id[session_id] = Session(session_id)
        return session

    def holds(self, session: Session) -> bool:
        """Whether ``session`` is still the one kept under its id."""
        return self._by_id.get(session.id) is session

    def discard(self, session: Session) -> None:
        """Forget ``session`` if no turn of it was recorded."""
        if not session.token_ids and self.holds(session):
            del self._by_id[session.id]

    def get(self, session_id: str) -> Session:
        """The session with a recorded turn under ``session_id``; KeyError if there is none."""
        found = self._by_id.get(session_id)
        if found is None or not found.token_ids:
            raise KeyError(session_id)
        return found

    def pop(self, session_id: str) -> Session:
        return self._by_id.pop(session_id)

    def __len__(self) -> int:
        return len(self._by_id)


class SessionLimit(Exception):
    """Too many sessions are open (answered 429)."""
