"""The FastAPI app: OpenAI's ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``
(whole, or streamed token by token as server-sent events), rollgen's sessions, cancel and status
endpoints. Tokenizing, rendering and reading replies run on the served generation's text
workers; the event loop only moves requests, tokens and bytes."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from rollgen.errors import RollgenError
from rollgen.rollout import SampleResult, TokenDelta
from rollgen.serving import errors, responses
from rollgen.serving.errors import HttpError
from rollgen.serving.guard import RequestGuard
from rollgen.serving.schemas import (
    SESSION_ID,
    SESSION_ID_RULE,
    CancelRequest,
    ChatCompletionRequest,
    CompletionRequest,
)
from rollgen.serving.sessions import Session
from rollgen.serving.state import Request as OpenAIRequest
from rollgen.serving.state import ServerState, Turn, collect
from rollgen.serving.streaming import ChoiceStream

logger = logging.getLogger(__name__)

#: A choice's whole answer from its result and the prompt (run on a text worker).
Choice = Callable[[SampleResult, list[int]], dict[str, Any]]
#: Records a session's turn from its results (run on a text worker).
Commit = Callable[[Session, list[SampleResult]], None]


def build_app(state: ServerState, api_key: str | None, lifespan: Any = None) -> FastAPI:
    """The app over ``state``; every ``/v1`` route needs ``Authorization: Bearer <api_key>``
    (checked before the body is read) unless ``api_key`` is None (auth turned off)."""
    app = FastAPI(title="rollgen", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    limits = state.limits
    errors.install(app, limits.retry_after_s)
    app.add_middleware(
        RequestGuard,
        api_key=api_key,
        max_body_bytes=limits.max_body_bytes,
        client_timeout_s=limits.client_timeout_s,
        retry_after_s=limits.retry_after_s,
    )
    served = state.served

    def check(req: OpenAIRequest) -> None:
        if req.model not in (served.model_id, served.facts.model_name):
            raise HttpError(
                404,
                f"model {req.model!r} is not served here; it serves {served.model_id!r}",
                "model_not_found",
            )
        bad = req.unsupported()
        if bad:
            raise HttpError(400, f"unsupported by rollgen serve: {', '.join(bad)}", "unsupported")

    def session_of(session_id: str) -> Session:
        if not SESSION_ID.fullmatch(session_id):
            raise HttpError(400, f"a session id holds {SESSION_ID_RULE}", "invalid_session_id")
        try:
            return state.sessions.get(session_id)
        except KeyError:
            raise HttpError(404, f"no session {session_id!r}", "session_not_found") from None

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "closing" if state.closing else "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        facts, live = served.facts, await served.port.live()
        return {
            "object": "list",
            "data": [
                {
                    "id": served.model_id,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "rollgen",
                    "max_model_len": facts.max_model_len,
                    "backend": facts.name,
                    "capabilities": list(facts.capabilities),
                    "logprobs_mode": served.logprobs_mode,
                    "weight_version": live.weight_version,
                }
            ],
        }

    @app.get("/v1/rollgen/status")
    async def status() -> dict[str, Any]:
        live = await served.port.live()
        return {
            "weight_version": live.weight_version,
            "usable": live.usable,
            "requests_running": state.running,
            "requests_waiting": served.waiting,
            "sessions": len(state.sessions),
            "closing": state.closing,
            "replicas": live.replicas,
        }

    @app.post("/v1/rollgen/cancel")
    async def cancel(req: CancelRequest) -> dict[str, Any]:
        turn = state.requests.get(req.request_id)
        if turn is None:
            raise HttpError(404, f"no request {req.request_id!r} is in flight", "request_not_found")
        turn.cancel()
        return {"request_id": req.request_id, "cancelled": True}

    @app.get("/v1/sessions/{session_id:path}")
    async def get_session(session_id: str) -> dict[str, Any]:
        return session_of(session_id).view()

    @app.delete("/v1/sessions/{session_id:path}")
    async def delete_session(session_id: str) -> dict[str, Any]:
        session = session_of(session_id)
        async with session.lock:  # a turn in flight ends first
            if not state.sessions.holds(session):  # deleted, or its first turn failed, meanwhile
                raise HttpError(404, f"no session {session_id!r}", "session_not_found")
            state.sessions.pop(session_id)
            return session.view() | {"deleted": True}

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
        check(req)
        stops = req.stop_strings()
        logprobs = req.logprobs is not None
        new_ids: list[int] = []

        def prompt(session: Session | None) -> list[int]:
            new_ids.extend(prompt_ids(req, served.encode))
            return (session.token_ids if session else []) + new_ids

        def choice(result: SampleResult, prompt: list[int]) -> dict[str, Any]:
            return responses.completion_choice(served, prompt, result, stops, logprobs)

        def commit(session: Session, results: list[SampleResult]) -> None:
            session.add_environment(new_ids)
            session.add_generated(results[0])

        return await run(request, req, "completion", prompt, choice, commit, logprobs, parsed=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatCompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
        check(req)
        messages = [m.for_template() for m in req.messages]
        tools = req.tools if req.tool_choice != "none" else None
        stops = req.stop_strings()
        parser = state.tool_parser if tools else None

        def render(msgs: list[dict[str, Any]], generation_prompt: bool) -> str:
            return served.render(msgs, generation_prompt, tools)

        turn_text: dict[str, Any] = {}

        def prompt(session: Session | None) -> list[int]:
            if session is None:
                return served.encode(render(messages, True))
            new_text, full, new = session.chat_prompt(messages, render)
            new_ids = served.encode(new_text)
            turn_text.update(full=full, new=new, ids=new_ids)
            return session.token_ids + new_ids

        def choice(result: SampleResult, prompt_ids: list[int]) -> dict[str, Any]:
            return responses.chat_choice(served, prompt_ids, result, stops, req.logprobs, parser)

        def commit(session: Session, results: list[SampleResult]) -> None:
            result = results[0]
            ended = ""
            if result.token_ids and result.stop_reason in ("eos", "stop_token"):
                ended = served.token_text(result.token_ids[-1])
            session.commit_chat(
                turn_text["new"],
                turn_text["ids"],
                turn_text["full"],
                result,
                served.decode(result.token_ids),
                ended,
                render,
            )

        return await run(
            request, req, "chat", prompt, choice, commit, req.logprobs, parsed=parser is not None
        )

    async def run(
        request: Request,
        req: OpenAIRequest,
        kind: str,
        prompt: Callable[[Session | None], list[int]],
        choice: Choice,
        commit: Commit,
        logprobs: bool,
        parsed: bool,
    ) -> JSONResponse | StreamingResponse:
        """One request's turn: its session taken, its prompt made (on a text worker) and
        submitted; then every choice at once, or its tokens as they come (``stream``). A client
        that leaves before its answer has its samples cancelled. ``logprobs``: OpenAI's field
        asked for; ``parsed``: a tool parser reads the replies (streamed text waits for it)."""
        turn = Turn(state, req)
        rid = responses.new_id("cmpl" if kind == "completion" else "chatcmpl")
        try:
            session = await turn.open(kind)
            await turn.start(await served.off_loop(prompt, session))
        except BaseException:
            turn.close()
            raise
        if req.stream:
            # text that may begin a stop string waits until the choice ends
            hold = None if parsed else max([0, *(len(s) - 1 for s in req.stop_strings())])
            return StreamingResponse(
                stream(turn, req, rid, kind, choice, commit, logprobs, hold), media_type="text/event-stream"
            )
        try:
            results = await unless_disconnected(request, collect(turn))
            if results is None:
                return JSONResponse({}, status_code=CLIENT_CLOSED)
            made = await served.off_loop(finish, turn, results, choice, commit)
            obj = "text_completion" if kind == "completion" else "chat.completion"
            return JSONResponse(responses.body(obj, rid, served.model_id, made, len(turn.prompt)))
        finally:
            turn.close()

    async def stream(
        turn: Turn,
        req: OpenAIRequest,
        rid: str,
        kind: str,
        choice: Choice,
        commit: Commit,
        logprobs: bool,
        hold: int | None,
    ) -> AsyncIterator[str]:
        """Server-sent events: each choice's tokens as the engine makes them (the events ready
        at once in one write), its last chunk when it ends, usage last if
        ``stream_options.include_usage``, then ``[DONE]``."""
        chat = kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        choices = [
            ChoiceStream(
                i,
                turn.prompt,
                served.text_stream(),
                hold,
                chat,
                logprobs,
                served.token_text,
                served.logprobs_mode,
            )
            for i in range(req.n)
        ]
        results: list[SampleResult] = []
        generated = 0
        try:
            async for batch in turn.events():
                shown = []
                for event in batch:
                    if isinstance(event, TokenDelta):
                        generated += len(event.token_ids)
                        shown.append(choices[event.index].delta(event))
                    else:
                        results.append(event)
                        final = await served.off_loop(choice, event, turn.prompt)
                        shown.append(choices[event.index].end(event, final))
                yield "".join(sse(responses.body(obj, rid, served.model_id, [c], None)) for c in shown)
            if turn.session is not None:
                await served.off_loop(commit, turn.session, sorted(results, key=lambda r: r.index))
            if (req.stream_options or {}).get("include_usage"):
                end = responses.body(obj, rid, served.model_id, [], None)
                end["usage"] = responses.usage_counts(len(turn.prompt), generated)
                yield sse(end)
        except RollgenError as exc:
            yield sse(errors.error_body(errors.status_of(exc)))
        finally:
            turn.close()
        yield "data: [DONE]\n\n"

    return app


def finish(turn: Turn, results: list[SampleResult], choice: Choice, commit: Commit) -> list[dict[str, Any]]:
    """A whole answer's choices, its session's turn recorded first (on a text worker)."""
    if turn.session is not None:
        commit(turn.session, results)
    return [choice(r, turn.prompt) for r in results]


def prompt_ids(req: CompletionRequest, encode: Callable[[str], list[int]]) -> list[int]:
    """The one prompt of a completion request, as token ids."""
    prompt: Any = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise HttpError(400, "one prompt per request (ask for several samples with n)", "unsupported")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return encode(prompt) if prompt else []
    return list(prompt)


#: What a request whose client left is answered (nobody reads it; nginx's convention).
CLIENT_CLOSED = 499
_T = TypeVar("_T")


async def unless_disconnected(request: Request, work: Awaitable[_T]) -> _T | None:
    """``work``'s result; None (``work`` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None


async def disconnected(request: Request) -> None:
    """Returns once the client has disconnected (its request body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        continue


def sse(data: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data)}\n\n"
