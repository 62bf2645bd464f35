"""The FastAPI app: OpenAI's ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``
(streamed as server-sent events or not), rollgen's sessions, cancel and status endpoints."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollgen.errors import RollgenError
from rollgen.rollout import SampleResult
from rollgen.serving import errors, responses
from rollgen.serving.errors import HttpError
from rollgen.serving.schemas import CancelRequest, ChatCompletionRequest, CompletionRequest
from rollgen.serving.state import Request as OpenAIRequest
from rollgen.serving.state import ServerState, Turn, collect


def build_app(state: ServerState, api_key: str | None, lifespan: Any = None) -> FastAPI:
    """The app over ``state``; every ``/v1`` route needs ``Authorization: Bearer <api_key>``
    unless ``api_key`` is None (auth turned off)."""
    app = FastAPI(title="rollgen", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    errors.install(app, state.limits.retry_after_s)
    app.add_middleware(BodyLimit, max_bytes=state.limits.max_body_bytes)
    served = state.served

    async def authorised(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), api_key.encode()):
            raise HttpError(401, "missing or wrong API key (Authorization: Bearer <key>)", "invalid_api_key")

    def check(req: OpenAIRequest) -> None:
        if req.model not in (served.model_id, served.gen.cfg["model_name"]):
            raise HttpError(
                404,
                f"model {req.model!r} is not served here; it serves {served.model_id!r}",
                "model_not_found",
            )
        bad = req.unsupported()
        if bad:
            raise HttpError(400, f"unsupported by rollgen serve: {', '.join(bad)}", "unsupported")

    guarded = [Depends(authorised)]

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "closing" if state.closing else "ok"}

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict[str, Any]:
        gen = served.gen
        return {
            "object": "list",
            "data": [
                {
                    "id": served.model_id,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "rollgen",
                    "max_model_len": gen.max_model_len,
                    "backend": gen.name,
                    "capabilities": sorted(c.value for c in gen.capabilities),
                    "logprobs_mode": served.logprobs_mode,
                    "weight_version": gen.weight_version,
                }
            ],
        }

    @app.get("/v1/rollgen/status", dependencies=guarded)
    async def status() -> dict[str, Any]:
        return {
            "weight_version": served.gen.weight_version,
            "usable": served.gen.usable,
            "requests_running": state.running,
            "requests_waiting": served.waiting,
            "sessions": len(state.sessions),
            "closing": state.closing,
            "replicas": [dataclasses.asdict(r) for r in served.gen.replica_load()],
        }

    @app.post("/v1/rollgen/cancel", dependencies=guarded)
    async def cancel(req: CancelRequest) -> dict[str, Any]:
        rollout = state.requests.get(req.request_id)
        if rollout is None:
            raise HttpError(404, f"no request {req.request_id!r} is in flight", "request_not_found")
        rollout.cancel()
        return {"request_id": req.request_id, "cancelled": True}

    @app.get("/v1/sessions/{session_id}", dependencies=guarded)
    async def get_session(session_id: str) -> dict[str, Any]:
        try:
            return state.sessions.get(session_id).view()
        except KeyError:
            raise HttpError(404, f"no session {session_id!r}", "session_not_found") from None

    @app.delete("/v1/sessions/{session_id}", dependencies=guarded)
    async def delete_session(session_id: str) -> dict[str, Any]:
        try:
            session = state.sessions.get(session_id)
        except KeyError:
            raise HttpError(404, f"no session {session_id!r}", "session_not_found") from None
        async with session.lock:  # a turn in flight ends first
            state.sessions.pop(session_id)
            return session.view() | {"deleted": True}

    @app.post("/v1/completions", dependencies=guarded, response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
        check(req)
        ids = prompt_ids(req, served.encode)
        stops = req.stop_strings()

        def choice(result: SampleResult, prompt: list[int]) -> dict[str, Any]:
            return responses.completion_choice(served, prompt, result, stops, req.logprobs is not None)

        async def commit(turn: Turn, results: list[SampleResult]) -> None:
            if turn.session is not None:
                turn.session.add_environment(ids)
                turn.session.add_generated(results[0])

        return await run(
            request,
            req,
            "completion",
            "text_completion",
            lambda s: (s.token_ids if s else []) + ids,
            choice,
            commit,
        )

    @app.post("/v1/chat/completions", dependencies=guarded, response_model=None)
    async def chat(req: ChatCompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
        check(req)
        messages = [m.for_template() for m in req.messages]
        tools = req.tools if req.tool_choice != "none" else None
        stops = req.stop_strings()
        parser = state.tool_parser if tools else None

        def render(msgs: list[dict[str, Any]], generation_prompt: bool) -> str:
            return served.render(msgs, generation_prompt, tools)

        turn_text: dict[str, Any] = {}

        def prompt(session: Any) -> list[int]:
            if session is None:
                return served.encode(render(messages, True))
            new_text, full, new = session.chat_prompt(messages, render)
            new_ids = served.encode(new_text)
            turn_text.update(full=full, new=new, ids=new_ids)
            return session.token_ids + new_ids

        def choice(result: SampleResult, prompt_ids: list[int]) -> dict[str, Any]:
            return responses.chat_choice(served, prompt_ids, result, stops, req.logprobs, parser)

        async def commit(turn: Turn, results: list[SampleResult]) -> None:
            if turn.session is None:
                return
            result = results[0]
            ended = ""
            if result.token_ids and result.stop_reason in ("eos", "stop_token"):
                ended = served.token_text(result.token_ids[-1])
            turn.session.commit_chat(
                turn_text["new"],
                turn_text["ids"],
                turn_text["full"],
                result,
                served.decode(result.token_ids),
                ended,
                render,
            )

        return await run(request, req, "chat", "chat.completion", prompt, choice, commit, chunks=True)

    async def run(
        request: Request,
        req: OpenAIRequest,
        kind: str,
        obj: str,
        prompt: Callable[[Any], list[int]],
        choice: Callable[[SampleResult, list[int]], dict[str, Any]],
        commit: Callable[[Turn, list[SampleResult]], Awaitable[None]],
        chunks: bool = False,
    ) -> JSONResponse | StreamingResponse:
        """One request's turn: its session taken, its prompt made and submitted; then every
        choice at once, or each as it finishes (``stream``). A client that leaves before its
        answer has its samples cancelled."""
        turn = Turn(state, req)
        rid = responses.new_id("cmpl" if kind == "completion" else "chatcmpl")
        try:
            session = await turn.open(kind)
            await turn.start(prompt(session))
        except BaseException:
            turn.close()
            raise
        if req.stream:
            return StreamingResponse(
                stream(turn, req, rid, obj + (".chunk" if chunks else ""), choice, commit, chunks),
                media_type="text/event-stream",
            )
        try:
            results = await unless_disconnected(request, collect(turn))
            if results is None:
                return JSONResponse({}, status_code=CLIENT_CLOSED)
            await commit(turn, results)
            made = [choice(r, turn.prompt) for r in results]
            return JSONResponse(responses.body(obj, rid, served.model_id, made, len(turn.prompt)))
        finally:
            turn.close()

    async def stream(
        turn: Turn,
        req: OpenAIRequest,
        rid: str,
        obj: str,
        choice: Callable[[SampleResult, list[int]], dict[str, Any]],
        commit: Callable[[Turn, list[SampleResult]], Awaitable[None]],
        chunks: bool,
    ) -> AsyncIterator[str]:
        """Server-sent events: a chunk per choice as it finishes (rollgen streams whole samples),
        usage last if ``stream_options.include_usage``, then ``[DONE]``."""
        results: list[SampleResult] = []
        made: list[dict[str, Any]] = []
        try:
            async for result in turn.results():
                results.append(result)
                made.append(choice(result, turn.prompt))
                shown = responses.chat_chunk(made[-1]) if chunks else made[-1]
                yield event(responses.body(obj, rid, served.model_id, [shown], None))
            await commit(turn, sorted(results, key=lambda r: r.index))
            if (req.stream_options or {}).get("include_usage"):
                end = responses.body(obj, rid, served.model_id, [], None)
                end["usage"] = responses.usage(len(turn.prompt), made)
                yield event(end)
        except RollgenError as exc:
            yield event(errors.error_body(errors.status_of(exc)))
        finally:
            turn.close()
        yield "data: [DONE]\n\n"

    return app


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


def event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


class BodyLimit:
    """Refuses (413) a request body over ``max_bytes``, by its Content-Length or as it arrives."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise HttpError(413, self._message(), "request_too_large")
            return message

        await self.app(scope, counted, send)

    def _message(self) -> str:
        return f"the request body is over the server's limit of {self.max_bytes} bytes (max_body_bytes)"

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        answer = errors.response(HttpError(413, self._message(), "request_too_large"), 0)
        await answer(scope, receive, send)
