"""``RequestGuard``, in front of the app: a ``/v1`` request's API key is checked before any of
its body is read (401), then the body is read whole, within ``max_body_bytes`` (413, whether
it declares its length or comes in chunks) and ``client_timeout_s`` (408), and handed to the app
as it came."""

from __future__ import annotations

import asyncio
import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollgen.serving import errors
from rollgen.serving.errors import HttpError

#: The routes that need the key (``/health`` does not).
GUARDED_PREFIX = "/v1"


class RequestGuard:
    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body_bytes: int,
        client_timeout_s: float,
        retry_after_s: int,
    ) -> None:
        self.app, self.api_key = app, api_key
        self.max_body_bytes, self.client_timeout_s, self.retry_after_s = (
            max_body_bytes,
            client_timeout_s,
            retry_after_s,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check_key(scope)
            body = await self._body(scope, receive)
        except HttpError as error:  # answered before its body was read: the connection ends
            answer = errors.response(error, self.retry_after_s)
            answer.headers["connection"] = "close"
            await answer(scope, receive, send)
            return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _check_key(self, scope: Scope) -> None:
        if self.api_key is None or not scope["path"].startswith(GUARDED_PREFIX):
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token, self.api_key.encode()):
            raise HttpError(401, "missing or wrong API key (Authorization: Bearer <key>)", "invalid_api_key")

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.client_timeout_s
        parts: list[bytes] = []
        seen = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise HttpError(
                    408,
                    f"the request's body did not arrive within {self.client_timeout_s:g} s "
                    "(client_timeout_s)",
                    "request_timeout",
                ) from None
            if message["type"] == "http.disconnect":
                raise HttpError(499, "the client left before its request's body arrived", "client_closed")
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_body_bytes:
                raise self._too_large()
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    def _too_large(self) -> HttpError:
        return HttpError(
            413,
            f"the request body is over the server's limit of {self.max_body_bytes} bytes (max_body_bytes)",
            "request_too_large",
        )
