"""``RemoteGeneration``: the generation contract over a ``rollgen serve`` endpoint. Each sample is
one ``/v1/completions`` request with token ids in and out (rollgen's extension fields), its
settings as the core resolved them; an aborted sample is cancelled on the server by its
``request_id`` (over connections of their own, so no cancel waits behind the requests it ends)
and returns the tokens it has; one aborted before its request went out is not sent."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from rollgen import BaseGeneration, BatchedDataDict
from rollgen.errors import ConfigError, WorkerError
from rollgen.output import assemble_from_lists
from rollgen.rollout import FinishedSample, SampleRequest
from rollgen.sampling import SampleParams
from rollgen.spec import Capability

logger = logging.getLogger(__name__)

#: Seconds after which an idle connection is not reused: below the 5 s that uvicorn-based servers
#: (vLLM's among them) keep one, so no request goes out on a connection the server is closing.
KEEPALIVE_EXPIRY_S = 2.0
#: Threads, each with a connection of its own, that send cancels beside the samples' requests.
CANCEL_THREADS = 4
#: Seconds between tries of a cancel the server does not know yet (its request on its way).
CANCEL_RETRY_S = 0.05


class ServerRefused(WorkerError):
    """The server answered with an error status (``code``: its error's code, if it names one)."""

    def __init__(self, server: str, message: str, code: str | None) -> None:
        super().__init__(server, message)
        self.code = code


class RemoteGeneration(BaseGeneration):
    """No refit here: the trainer beside the server refits it (no engine is linked, and the
    capabilities refuse refits)."""

    def __init__(self, config: Mapping[str, Any], cluster: Any = None, backend: Any = None) -> None:
        super().__init__(config, cluster=cluster, backend=backend)
        remote = self.cfg["remote_cfg"]
        self.url = remote["url"].rstrip("/")
        key = remote.get("api_key") or os.environ.get("ROLLGEN_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.timeout_s = float(remote["timeout_s"])
        self._http, self._control = (
            httpx.Client(
                headers=headers,
                timeout=self.timeout_s,
                limits=httpx.Limits(max_connections=n, keepalive_expiry=KEEPALIVE_EXPIRY_S),
            )
            for n in (remote["max_connections"], CANCEL_THREADS)
        )
        #: Names this client's requests apart from other clients' on the server.
        self._tag = uuid.uuid4().hex[:12]
        self._pool = ThreadPoolExecutor(remote["max_connections"], thread_name_prefix="rollgen-remote")
        self._cancels = ThreadPoolExecutor(CANCEL_THREADS, thread_name_prefix="rollgen-remote-cancel")
        #: Streamed samples not yet sent, and those whose request is out.
        self._waiting: set[str] = set()
        self._sending: set[str] = set()
        self._keys = threading.Lock()
        try:
            self.model_id = self._check_server()
        except BaseException:
            self._shutdown()
            raise

    @property
    def reads_weights(self) -> bool:
        return False

    def _check_server(self) -> str:
        """The served model's id; ConfigError where the server does not serve what this
        client's config says (its context, logprobs mode, the capabilities a client needs)."""
        (model,) = self._call("GET", "/models")["data"]
        problems = []
        if model.get("max_model_len") is not None and model["max_model_len"] < self.max_model_len:
            problems.append(
                f"the server's context is {model['max_model_len']}, this config's {self.max_model_len}"
            )
        if model.get("logprobs_mode") != self.cfg["logprobs_mode"]:
            problems.append(
                f"the server returns {model.get('logprobs_mode')} logprobs, this config asks for "
                f"{self.cfg['logprobs_mode']}"
            )
        needed = {Capability.PER_SAMPLE_SAMPLING.value, Capability.STOP_STRINGS.value}
        missing = sorted(needed - set(model.get("capabilities", [])))
        if missing:
            problems.append(f"the server's backend lacks {missing}, which a remote client passes per sample")
        if problems:
            raise ConfigError(f"remote server {self.url} does not serve this config", problems)
        return str(model["id"])

    def _call(
        self, method: str, path: str, body: Any = None, http: httpx.Client | None = None
    ) -> dict[str, Any]:
        """One request to the server (on ``http``, else the samples' client); WorkerError where
        it cannot be reached, refuses, or answers what is not JSON."""
        try:
            answer = (http or self._http).request(method, self.url + path, json=body)
        except httpx.HTTPError as exc:
            raise WorkerError(f"server {self.url}", f"{method} {path} failed: {exc}") from None
        if answer.status_code != 200:
            try:
                error = answer.json()["error"]
                message, code = str(error["message"]), error.get("code")
            except (ValueError, KeyError, TypeError, AttributeError):
                message, code = answer.text[:500], None
            raise ServerRefused(
                f"server {self.url}",
                f"{method} {path}: {answer.status_code} {message}",
                code,
            )
        try:
            data: dict[str, Any] = answer.json()
        except ValueError:
            raise WorkerError(
                f"server {self.url}", f"{method} {path}: the answer is not JSON: {answer.text[:200]!r}"
            ) from None
        return data

    def _body(self, prompt: list[int], params: SampleParams, request_id: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model_id,
            "prompt": prompt,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop_strings:
            body["stop"] = list(params.stop_strings)
        if request_id is not None:
            body["request_id"] = request_id
        return body

    def _sample(
        self, prompt: list[int], params: SampleParams, request_id: str | None = None
    ) -> dict[str, Any]:
        """One sample's tokens, logprobs and stop reason, cut after the first of this client's
        stop ids (the server stops at its own)."""
        answer = self._call("POST", "/completions", self._body(prompt, params, request_id))
        try:
            fields = answer["choices"][0]["rollgen"]
            tokens, logprobs = list(fields["token_ids"]), list(fields["logprobs"])
            reason = str(fields["stop_reason"])
        except (KeyError, IndexError, TypeError) as exc:
            raise WorkerError(
                f"server {self.url}",
                f"its answer lacks rollgen's fields ({type(exc).__name__}: {exc}): is it a rollgen server?",
            ) from None
        cut = next((i + 1 for i, t in enumerate(tokens) if t in params.stop_token_ids), len(tokens))
        return {"tokens": tokens[:cut], "logprobs": logprobs[:cut], "stop_reason": reason}

    def _generate(self, batch: BatchedDataDict[Any], params: list[SampleParams]) -> BatchedDataDict[Any]:
        prompts = [ids[:n].tolist() for ids, n in zip(batch["input_ids"], batch["input_lengths"].tolist())]
        samples = list(self._pool.map(self._sample, prompts, params))
        return assemble_from_lists(
            batch["input_ids"],
            batch["input_lengths"],
            [s["tokens"] for s in samples],
            [s["logprobs"] for s in samples],
            self.cfg["pad_token_id"],
        )

    # ---- streamed samples: a request each, cancelled on the server by its key -----------------
    def _stream_start(self, requests: list[SampleRequest]) -> None:
        with self._keys:
            self._waiting.update(r.key for r in requests)
        for request in requests:
            self._pool.submit(self._stream_one, request)

    def _stream_one(self, request: SampleRequest) -> None:
        key = request.key
        with self._keys:
            if key not in self._waiting:  # aborted before its request went out (and reported)
                return
            self._waiting.remove(key)
            self._sending.add(key)
        try:
            sample = self._sample(list(request.prompt_ids), request.params, f"{self._tag}:{key}")
        except Exception as exc:  # noqa: BLE001 - reported as the sample's error: none is left unreported
            if not isinstance(exc, WorkerError):
                logger.exception("remote sample %s failed", key)
            self._streams.deliver([FinishedSample(key, (), (), error=str(exc))])
            return
        finally:
            with self._keys:
                self._sending.discard(key)
        aborted = sample["stop_reason"] in ("aborted", "cancelled")
        self._streams.deliver(
            [FinishedSample(key, tuple(sample["tokens"]), tuple(sample["logprobs"]), aborted=aborted)]
        )

    def _stream_abort(self, keys: list[str]) -> None:
        with self._keys:
            unsent = [key for key in keys if key in self._waiting]
            self._waiting.difference_update(unsent)
            out = [key for key in keys if key in self._sending]
        if unsent:
            self._streams.deliver(
                [FinishedSample(key, (), (), aborted=True, started=False) for key in unsent]
            )
        for key in out:
            self._cancels.submit(self._cancel, key)

    def _cancel(self, key: str) -> None:
        """Cancel ``key`` on the server, again while the server does not know it yet and its
        request is still out (on its way), for up to ``timeout_s``; one that finished reports
        itself."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                self._call("POST", "/rollgen/cancel", {"request_id": f"{self._tag}:{key}"}, self._control)
                return
            except ServerRefused as exc:
                with self._keys:
                    out = key in self._sending
                if not (out and exc.code == "request_not_found") or time.monotonic() > deadline:
                    logger.debug("cancel of %s: %s", key, exc)
                    return
            except WorkerError as exc:
                logger.warning("cancel of %s did not reach the server (it runs to its end): %s", key, exc)
                return
            time.sleep(CANCEL_RETRY_S)

    def _shutdown(self) -> None:
        for pool in (self._pool, self._cancels):
            pool.shutdown(wait=True, cancel_futures=True)
        self._http.close()
        self._control.close()
