"""``RemoteGeneration``: the generation contract over a ``rollgen serve`` endpoint. Each sample is
one ``/v1/completions`` request with token ids in and out (rollgen's extension fields), its
settings as the core resolved them; an aborted sample is cancelled on the server by its
``request_id`` and returns the tokens it has."""

from __future__ import annotations

import logging
import os
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


class RemoteGeneration(BaseGeneration):
    """No refit here: the trainer beside the server refits it (no engine is linked, and the
    capabilities refuse refits)."""

    def __init__(self, config: Mapping[str, Any], cluster: Any = None, backend: Any = None) -> None:
        super().__init__(config, cluster=cluster, backend=backend)
        remote = self.cfg["remote_cfg"]
        self.url = remote["url"].rstrip("/")
        key = remote.get("api_key") or os.environ.get("ROLLGEN_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.Client(
            headers=headers,
            timeout=remote["timeout_s"],
            limits=httpx.Limits(
                max_connections=remote["max_connections"], keepalive_expiry=KEEPALIVE_EXPIRY_S
            ),
        )
        #: Names this client's requests apart from other clients' on the server.
        self._tag = uuid.uuid4().hex[:12]
        self._pool = ThreadPoolExecutor(remote["max_connections"], thread_name_prefix="rollgen-remote")
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

    def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        """One request to the server; WorkerError where it cannot be reached or refuses."""
        try:
            answer = self._http.request(method, self.url + path, json=body)
        except httpx.HTTPError as exc:
            raise WorkerError(f"server {self.url}", f"{method} {path} failed: {exc}") from None
        if answer.status_code != 200:
            try:
                message = answer.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = answer.text[:500]
            raise WorkerError(f"server {self.url}", f"{method} {path}: {answer.status_code} {message}")
        data: dict[str, Any] = answer.json()
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
        choice = self._call("POST", "/completions", self._body(prompt, params, request_id))["choices"][0]
        fields = choice["rollgen"]
        tokens, logprobs = list(fields["token_ids"]), list(fields["logprobs"])
        cut = next((i + 1 for i, t in enumerate(tokens) if t in params.stop_token_ids), len(tokens))
        return {"tokens": tokens[:cut], "logprobs": logprobs[:cut], "stop_reason": fields["stop_reason"]}

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
        for request in requests:
            self._pool.submit(self._stream_one, request)

    def _stream_one(self, request: SampleRequest) -> None:
        try:
            sample = self._sample(list(request.prompt_ids), request.params, f"{self._tag}:{request.key}")
        except WorkerError as exc:
            self._streams.deliver([FinishedSample(request.key, (), (), error=str(exc))])
            return
        aborted = sample["stop_reason"] in ("aborted", "cancelled")
        self._streams.deliver(
            [FinishedSample(request.key, tuple(sample["tokens"]), tuple(sample["logprobs"]), aborted=aborted)]
        )

    def _stream_abort(self, keys: list[str]) -> None:
        for key in keys:
            self._pool.submit(self._cancel, key)

    def _cancel(self, key: str) -> None:
        """Cancel ``key`` on the server; one that finished already (404) reports itself."""
        try:
            self._call("POST", "/rollgen/cancel", {"request_id": f"{self._tag}:{key}"})
        except WorkerError as exc:
            logger.debug("cancel of %s: %s", key, exc)

    def _shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._http.close()
