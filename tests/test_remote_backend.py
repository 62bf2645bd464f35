"""The remote backend's client side against a stand-in server (a small FastAPI app, named as
such): it holds each completion until it is cancelled, or answers what a rollgen server never
does, faults a real server cannot be made to produce on cue. The remote backend against the real
``rollgen serve`` is in the conformance suite (``make test``) and ``test_serving.py``."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

import rollgen
from rollgen.errors import RollgenError
from rollgen.testing.config import tiny_config
from tests.waiting import SAFETY_S, rollout_outcome, wait_until


class StandInServer:
    """A stand-in for ``rollgen serve`` on a thread: ``/v1/models`` as the real one answers it;
    ``/v1/completions`` held until ``/v1/rollgen/cancel`` names its ``request_id`` (then one
    token, ``cancelled``), or, with ``malformed``, answered at once without rollgen's fields."""

    def __init__(self, malformed: bool = False) -> None:
        self.malformed = malformed
        self.held: dict[str, asyncio.Event] = {}
        self.completions = 0
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            model = {
                "id": "stand-in",
                "max_model_len": 1 << 20,
                "logprobs_mode": "raw",
                "capabilities": ["per_sample_sampling", "stop_strings", "async"],
            }
            return {"object": "list", "data": [model]}

        @app.post("/v1/completions")
        async def completions(body: dict[str, Any]) -> dict[str, Any]:
            self.completions += 1
            if self.malformed:
                return {"choices": []}
            cancelled = self.held[body["request_id"]] = asyncio.Event()
            await asyncio.wait_for(cancelled.wait(), SAFETY_S)
            fields = {"token_ids": [7], "logprobs": [-0.5], "stop_reason": "cancelled"}
            return {"choices": [{"text": "", "rollgen": fields}]}

        @app.post("/v1/rollgen/cancel")
        async def cancel(body: dict[str, Any]) -> Any:
            if body["request_id"] not in self.held:
                error = {"message": "no such request", "code": "request_not_found"}
                return JSONResponse({"error": error}, status_code=404)
            self.held[body["request_id"]].set()
            return {"request_id": body["request_id"], "cancelled": True}

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        wait_until(lambda: self._server.started, "the stand-in server started")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(SAFETY_S)


@pytest.fixture
def stand_in(request: pytest.FixtureRequest) -> Iterator[StandInServer]:
    server = StandInServer(malformed=getattr(request, "param", False))
    yield server
    server.stop()


def remote(server: StandInServer) -> Any:
    config = tiny_config(
        "remote",
        remote_cfg={"url": server.url, "api_key": "k" * 20, "max_connections": 2, "timeout_s": SAFETY_S},
    )
    return rollgen.create_generation(config)


def batch(n: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.tensor([[5, 6, 7]] * n), "input_lengths": torch.tensor([3] * n)}


def test_a_cancel_does_not_wait_behind_the_requests_it_ends(stand_in: StandInServer) -> None:
    """Six samples on two connections: the two sent are cancelled on the server (their cancels
    go out on connections of their own), the four not yet sent are never sent."""
    with remote(stand_in) as gen:
        rollout = gen.submit(batch(6))
        wait_until(lambda: len(stand_in.held) == 2, "two requests held by the server")
        rollout.cancel()
        results = rollout_outcome(rollout)
    assert isinstance(results, list), results
    assert [r.stop_reason for r in results] == ["cancelled"] * 6
    assert sorted(len(r.token_ids) for r in results) == [0, 0, 0, 0, 1, 1]
    assert stand_in.completions == 2


@pytest.mark.parametrize("stand_in", [True], indirect=True)
def test_an_answer_without_rollgen_fields_fails_its_rollout(stand_in: StandInServer) -> None:
    """Not a hang: the sample ends with the error, which its rollout raises."""
    with remote(stand_in) as gen:
        error = rollout_outcome(gen.submit(batch(1)))
    assert isinstance(error, RollgenError) and "lacks rollgen's fields" in str(error)
