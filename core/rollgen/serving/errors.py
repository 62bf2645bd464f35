"""Errors as OpenAI's error shape (``{"error": {"message", "type", "param", "code"}}``): every
answer that is not a success is JSON, with the status rollgen's error calls for."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from rollgen.errors import (
    ConfigError,
    EngineAsleep,
    EngineClosed,
    InputError,
    RollgenError,
    StaleWeights,
    UnsupportedCapability,
    WorkerError,
)

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class HttpError(Exception):
    """An answer other than success: ``status``, the message, OpenAI's ``code``; ``retry``: a
    503 that says ``Retry-After``."""

    def __init__(self, status: int, message: str, code: str | None = None, *, retry: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.retry = status, message, code, retry


def status_of(exc: RollgenError) -> HttpError:
    """The answer for a rollgen error raised while serving a request."""
    if isinstance(exc, (InputError, UnsupportedCapability, ConfigError)):
        return HttpError(400, str(exc), type(exc).__name__)
    if isinstance(exc, (EngineAsleep, StaleWeights)):
        return HttpError(503, str(exc), type(exc).__name__, retry=True)
    if isinstance(exc, (EngineClosed, WorkerError)):
        return HttpError(503, str(exc), type(exc).__name__)
    return HttpError(500, str(exc), type(exc).__name__)


def error_body(error: HttpError) -> dict[str, object]:
    return {
        "error": {
            "message": error.message,
            "type": _TYPES.get(error.status, "server_error"),
            "param": None,
            "code": error.code,
        }
    }


def response(error: HttpError, retry_after_s: int) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if error.retry else None
    if error.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)


def install(app: FastAPI, retry_after_s: int) -> None:
    """Every error the app can meet, answered as JSON."""

    @app.exception_handler(HttpError)
    async def _http(request: Request, exc: HttpError) -> JSONResponse:
        return response(exc, retry_after_s)

    @app.exception_handler(RollgenError)
    async def _rollgen(request: Request, exc: RollgenError) -> JSONResponse:
        error = status_of(exc)
        if error.status >= 500:
            logger.error("%s %s: %s", request.method, request.url.path, exc)
        return response(error, retry_after_s)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        return response(HttpError(400, f"invalid request: {problems}", "invalid_request"), retry_after_s)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("%s %s failed", request.method, request.url.path)
        return response(HttpError(500, f"internal error: {type(exc).__name__}: {exc}"), retry_after_s)

    @app.exception_handler(HTTPException)
    async def _starlette(request: Request, exc: HTTPException) -> JSONResponse:
        return response(HttpError(exc.status_code, str(exc.detail)), retry_after_s)
