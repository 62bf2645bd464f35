"""Refits while serving: the trainer's ``gen.refit`` beside the server, requests in flight
following its ``mode``, and every token's weight version in the responses and sessions."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

import rollgen
from rollgen.testing import load_reference_model, tiny_config, tiny_model_dir, versioned_logprob_error
from tests.waiting import SAFETY_S

KEY = "refit-key-" + "0" * 24


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Any, Any, openai.OpenAI]]:
    with rollgen.create_generation(tiny_config("hf", max_new_tokens=8)) as gen:
        with rollgen.serve(gen, api_key=KEY) as server:
            yield gen, server, openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def untrained() -> Any:
    return load_reference_model(tiny_model_dir(trained=False), torch.float32)


@pytest.fixture(scope="module")
def trained() -> Any:
    return load_reference_model(tiny_model_dir(), torch.float32)


def spans(done: Any) -> list[dict[str, int]]:
    return list(done.choices[0].model_extra["rollgen"]["versions"])


def test_session_turns_carry_the_version_of_their_weights(
    served: tuple[Any, Any, openai.OpenAI], untrained: Any, trained: Any
) -> None:
    gen, server, client = served
    messages: list[Any] = [{"role": "user", "content": "count: 1 2"}]
    first = client.chat.completions.create(
        model=server.model_id, messages=messages, max_tokens=4, extra_body={"session_id": "v"}
    )
    before = gen.weight_version
    gen.refit(untrained)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "abc: a b"},
    ]
    second = client.chat.completions.create(
        model=server.model_id, messages=messages, max_tokens=4, extra_body={"session_id": "v"}
    )
    assert {s["version"] for s in spans(first)} == {before}
    assert {s["version"] for s in spans(second)} == {before + 1}
    session = httpx.get(
        f"{server.url}/sessions/v", headers={"Authorization": f"Bearer {KEY}"}, timeout=SAFETY_S
    ).json()
    assert [s["version"] for s in session["versions"]] == [before, before + 1]
    error = versioned_logprob_error(
        session["token_ids"],
        session["logprobs"],
        session["versions"],
        {before: trained, before + 1: untrained},
    )
    assert error < 1e-4, f"the session's logprobs are not those of its versions' weights ({error})"
    gen.refit(trained)


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_refit_in_flight_follows_its_mode(
    mode: str, served: tuple[Any, Any, openai.OpenAI], untrained: Any, trained: Any
) -> None:
    """A long request running while the trainer refits: ``keep`` continues it on the new
    weights (its tokens carry both versions where the refit landed mid-sample), ``abort`` ends
    it with the tokens it has. Where the refit lands depends on the machine; every check holds
    wherever it does; every token's logprob is that of its version's weights."""
    gen, server, client = served
    gen.refit(untrained)  # samples on the untrained weights rarely end early
    running = gen.weight_version
    answer: dict[str, Any] = {}

    def ask() -> None:
        answer["done"] = client.completions.create(
            model=server.model_id, prompt="count: 1 2", max_tokens=60, temperature=3.0, seed=1
        )

    asking = threading.Thread(target=ask)
    asking.start()
    status = client.with_options(timeout=30.0)
    while (
        asking.is_alive()
        and status.get("/rollgen/status", cast_to=httpx.Response).json()["requests_running"] == 0
    ):
        pass  # the request has not reached the server yet
    gen.refit(trained, mode=mode)
    asking.join()
    choice = answer["done"].choices[0]
    fields = choice.model_extra["rollgen"]
    versions = [s["version"] for s in fields["versions"]]
    updated = running + 1
    assert gen.weight_version == updated
    if mode == "keep":
        assert versions in ([running], [running, updated], [updated]), fields["versions"]
        assert fields["stop_reason"] not in ("aborted", "cancelled")
    else:
        assert versions in ([running], [updated]), fields["versions"]
        if fields["stop_reason"] == "aborted":
            assert choice.finish_reason == "abort" and versions == [running]
    assert sum(s["end"] - s["start"] for s in fields["versions"]) == len(fields["token_ids"])
    prompt = fields["prompt_token_ids"]
    error = versioned_logprob_error(
        prompt + fields["token_ids"],
        [None] * len(prompt) + fields["logprobs"],
        [{**s, "start": s["start"] + len(prompt), "end": s["end"] + len(prompt)} for s in fields["versions"]],
        {running: untrained, updated: trained},
    )
    assert error < 1e-4, f"{mode}: logprobs are not those of their versions' weights ({error})"
