"""``rollgen.serve`` over the hf backend on the tiny model, driven by the official openai SDK:
the OpenAI surface, the token-in/token-out fields, sessions, auth and errors."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import rollgen
from rollgen.errors import ConfigError, UnsupportedCapability
from rollgen.serving import HermesToolParser, Limits
from rollgen.testing import tiny_config
from tests.waiting import SAFETY_S, asleep_until_released

KEY = "test-key-" + "0" * 24
PROMPT = "count: 3 4 5"


@pytest.fixture(scope="module")
def gen() -> Iterator[Any]:
    with rollgen.create_generation(tiny_config("hf", max_new_tokens=8, seed=0)) as g:
        yield g


@pytest.fixture(scope="module")
def server(gen: Any) -> Iterator[Any]:
    with rollgen.serve(gen, api_key=KEY, limits=Limits(max_body_bytes=64 * 1024)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)


def ext(choice: Any) -> dict[str, Any]:
    """A choice's rollgen extension field."""
    return dict(choice.model_extra["rollgen"])


def test_models_lists_the_served_model(client: openai.OpenAI, server: Any, gen: Any) -> None:
    (model,) = client.models.list().data
    assert model.id == server.model_id
    assert model.model_extra["max_model_len"] == gen.max_model_len
    assert model.model_extra["backend"] == "hf" and "async" in model.model_extra["capabilities"]


def test_completion_is_the_engines_generation(client: openai.OpenAI, server: Any, gen: Any) -> None:
    """Greedy text and token ids over the wire equal the in-process greedy generate."""
    ids = gen.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    done = client.completions.create(model=server.model_id, prompt=PROMPT, temperature=0, logprobs=0)
    (choice,) = done.choices
    fields = ext(choice)
    batch = {"input_ids": torch.tensor([ids]), "input_lengths": torch.tensor([len(ids)])}
    out = gen.generate(batch, greedy=True)
    n = int(out["generation_lengths"][0])
    assert fields["prompt_token_ids"] == ids
    assert fields["token_ids"] == out["output_ids"][0, len(ids) : len(ids) + n].tolist()
    assert fields["logprobs"] == pytest.approx(out["logprobs"][0, len(ids) : len(ids) + n].tolist(), abs=1e-5)
    assert fields["logprobs_mode"] == "raw"
    assert fields["versions"] == [{"version": gen.weight_version, "start": 0, "end": n}]
    assert choice.text == gen.tokenizer.decode(fields["token_ids"], skip_special_tokens=True)
    assert choice.logprobs is not None and choice.logprobs.token_logprobs == fields["logprobs"]
    assert choice.finish_reason == {"eos": "stop", "length": "length"}[fields["stop_reason"]]
    assert done.usage is not None and done.usage.prompt_tokens == len(ids)
    by_ids = client.completions.create(model=server.model_id, prompt=ids, temperature=0)
    assert ext(by_ids.choices[0])["token_ids"] == fields["token_ids"]


def test_seeded_choices_repeat_and_budget_holds(client: openai.OpenAI, server: Any) -> None:
    def ask() -> list[list[int]]:
        done = client.chat.completions.create(
            model=server.model_id,
            messages=[{"role": "user", "content": PROMPT}],
            n=3,
            seed=11,
            temperature=1.0,
            max_completion_tokens=5,
            extra_body={"top_k": 20},
        )
        assert [c.index for c in done.choices] == [0, 1, 2]
        return [ext(c)["token_ids"] for c in done.choices]

    first = ask()
    assert first == ask()
    assert all(1 <= len(t) <= 5 for t in first)


def joined(chunks: list[Any]) -> dict[str, Any]:
    """The streamed choice 0's chunks put together: its text, rollgen fields and finish."""
    mine = [c.choices[0] for c in chunks if c.choices]
    fields = [ext(c) for c in mine]
    spans: list[dict[str, int]] = []
    for f in fields:
        for span in f["versions"]:
            if spans and spans[-1]["version"] == span["version"] and spans[-1]["end"] == span["start"]:
                spans[-1]["end"] = span["end"]
            else:
                spans.append(dict(span))
    text = "".join((c.delta.content or "") if hasattr(c, "delta") else c.text for c in mine)
    return {
        "text": text,
        "token_ids": [t for f in fields for t in f["token_ids"]],
        "logprobs": [lp for f in fields for lp in f["logprobs"]],
        "versions": spans,
        "prompt_token_ids": fields[0]["prompt_token_ids"],
        "stop_reason": fields[-1]["stop_reason"],
        "finish_reason": [c.finish_reason for c in mine if c.finish_reason],
        "token_chunks": sum(1 for f in fields if f["token_ids"]),
    }


def test_streamed_chat_sends_tokens_as_they_are_made(client: openai.OpenAI, server: Any) -> None:
    """``stream=True``: the tokens come in several chunks as the engine makes them, each with
    its ids, logprobs and version span; put together they are the whole answer's."""
    messages: Any = [{"role": "user", "content": PROMPT}]
    ask: Any = {
        "model": server.model_id,
        "messages": messages,
        "temperature": 2.0,
        "seed": 2,  # six tokens, one of them half a character (held until it is whole)
        "max_tokens": 6,
    }
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    got, want = joined(chunks), ext(whole.choices[0])
    assert got["text"] == whole.choices[0].message.content
    assert got["finish_reason"] == [whole.choices[0].finish_reason]
    for key in ("token_ids", "versions", "prompt_token_ids", "stop_reason"):
        assert got[key] == want[key], key
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5)
    assert len(want["token_ids"]) > 1 and got["token_chunks"] > 1, "tokens come as they are made"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == whole.usage.total_tokens  # type: ignore[union-attr]


def test_streamed_completion_holds_back_what_may_begin_a_stop_string(
    client: openai.OpenAI, server: Any
) -> None:
    """A streamed completion with a stop string: the text never shows the stop string, even in
    part, and ends as the whole answer's does."""
    plain = client.completions.create(model=server.model_id, prompt=PROMPT, temperature=0, max_tokens=8)
    stop = plain.choices[0].text.strip()[-2:]
    whole = client.completions.create(
        model=server.model_id, prompt=PROMPT, temperature=0, max_tokens=8, stop=[stop], logprobs=0
    )
    chunks = list(
        client.completions.create(
            model=server.model_id,
            prompt=PROMPT,
            temperature=0,
            max_tokens=8,
            stop=[stop],
            logprobs=0,
            stream=True,
        )
    )
    got = joined(chunks)
    assert got["text"] == whole.choices[0].text and stop not in got["text"]
    assert got["token_ids"] == ext(whole.choices[0])["token_ids"] and got["stop_reason"] == "stop_string"
    shown = ""
    for c in chunks:
        shown += c.choices[0].text
        assert stop[0] not in shown[len(whole.choices[0].text) :], "part of the stop string was sent"
    streamed_lps = [
        lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed_lps == pytest.approx(got["logprobs"])


def test_a_streamed_session_turn_is_recorded_as_a_whole_one(client: openai.OpenAI, server: Any) -> None:
    messages: list[Any] = [{"role": "user", "content": "abc: a b"}]
    chunks = list(
        client.chat.completions.create(
            model=server.model_id,
            messages=messages,
            max_tokens=5,
            temperature=0,
            stream=True,
            extra_body={"session_id": "streamed"},
        )
    )
    got = joined(chunks)
    session = client.get("/sessions/streamed", cast_to=httpx.Response).json()
    assert session["token_ids"] == got["prompt_token_ids"] + got["token_ids"]
    assert session["versions"] == [
        {
            **s,
            "start": s["start"] + len(got["prompt_token_ids"]),
            "end": s["end"] + len(got["prompt_token_ids"]),
        }
        for s in got["versions"]
    ]
    messages += [{"role": "assistant", "content": got["text"]}, {"role": "user", "content": "count: 1"}]
    after = client.chat.completions.create(
        model=server.model_id, messages=messages, max_tokens=2, extra_body={"session_id": "streamed"}
    )
    assert ext(after.choices[0])["prompt_token_ids"][: len(session["token_ids"])] == session["token_ids"]


def test_async_client_runs_requests_at_once(server: Any) -> None:
    async def run() -> list[Any]:
        aclient = openai.AsyncOpenAI(base_url=server.url, api_key=KEY, max_retries=0)
        asks = [
            aclient.completions.create(model=server.model_id, prompt=f"count: {i} {i + 1}", temperature=0)
            for i in range(4)
        ]
        return list(await asyncio.gather(*asks))

    done = asyncio.run(run())
    assert all(ext(d.choices[0])["prompt_token_ids"] for d in done)
    assert len({tuple(ext(d.choices[0])["prompt_token_ids"]) for d in done}) == 4


def test_session_keeps_the_engines_tokens(client: openai.OpenAI, server: Any, gen: Any) -> None:
    """Two turns sampled hot (random tokens, which BPE would merge otherwise): each prompt is
    the session's tokens so far plus only the new message; the session's tokens differ from a
    retokenization of its text, and read back exactly."""
    tok = gen.tokenizer
    messages: list[Any] = [{"role": "user", "content": "abc: a b c"}]
    sid = "session-drift"
    seen: list[int] = []
    turns = []
    for i, follow in enumerate(["count: 7 8", "abc: k l"]):
        done = client.chat.completions.create(
            model=server.model_id,
            messages=messages,
            temperature=3.0,
            seed=5 + i,
            max_tokens=6,
            extra_body={"session_id": sid},
        )
        fields = ext(done.choices[0])
        assert fields["prompt_token_ids"][: len(seen)] == seen, "a turn's prompt starts with the session"
        seen = fields["prompt_token_ids"] + fields["token_ids"]
        turns.append(fields)
        messages += [
            {"role": "assistant", "content": done.choices[0].message.content},
            {"role": "user", "content": follow},
        ]
    auth = {"Authorization": f"Bearer {KEY}"}
    session = httpx.get(f"{server.url}/sessions/{sid}", headers=auth, timeout=SAFETY_S).json()
    assert session["token_ids"] == seen
    generated = [i for i, m in enumerate(session["loss_mask"]) if m]
    assert [session["token_ids"][i] for i in generated] == turns[0]["token_ids"] + turns[1]["token_ids"]
    assert [session["logprobs"][i] for i in generated] == turns[0]["logprobs"] + turns[1]["logprobs"]
    assert all(session["logprobs"][i] is None for i, m in enumerate(session["loss_mask"]) if not m)
    assert sum(s["end"] - s["start"] for s in session["versions"]) == len(generated)
    retokenized = tok(tok.decode(session["token_ids"]), add_special_tokens=False)["input_ids"]
    assert retokenized != session["token_ids"], "pick a conversation whose text retokenizes differently"
    gone = httpx.delete(f"{server.url}/sessions/{sid}", headers=auth, timeout=SAFETY_S)
    assert gone.status_code == 200 and gone.json()["token_ids"] == seen
    assert httpx.get(f"{server.url}/sessions/{sid}", headers=auth, timeout=SAFETY_S).status_code == 404


def test_session_refuses_a_changed_history(client: openai.OpenAI, server: Any) -> None:
    first: list[Any] = [{"role": "user", "content": "count: 1 2"}]
    done = client.chat.completions.create(
        model=server.model_id, messages=first, max_tokens=3, extra_body={"session_id": "branch"}
    )
    changed = [
        {"role": "user", "content": "count: 9"},
        done.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "abc: a"},
    ]
    with pytest.raises(openai.BadRequestError, match="not the one the session holds"):
        client.chat.completions.create(
            model=server.model_id, messages=changed, max_tokens=3, extra_body={"session_id": "branch"}
        )


def test_tool_calls_are_parsed() -> None:
    """The built-in parser on the text a Hermes/Qwen-style model writes (the tiny model writes
    no tool calls of its own)."""
    text = 'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    rest, calls = HermesToolParser().parse(text)
    assert rest == "Let me add."
    assert [(c.name, c.arguments) for c in calls] == [("add", '{"a": 1, "b": 2}')]
    broken = "<tool_call>{not json}</tool_call>"
    assert HermesToolParser().parse(broken) == (broken, [])


def test_chat_with_tools_renders_them(client: openai.OpenAI, server: Any) -> None:
    tools: Any = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    plain = client.chat.completions.create(
        model=server.model_id, messages=[{"role": "user", "content": PROMPT}], max_tokens=2
    )
    offered = client.chat.completions.create(
        model=server.model_id, messages=[{"role": "user", "content": PROMPT}], max_tokens=2, tools=tools
    )
    extra = len(ext(offered.choices[0])["prompt_token_ids"]) - len(ext(plain.choices[0])["prompt_token_ids"])
    assert extra > 10, "the template's tool block is in the prompt"


def test_auth_is_required(server: Any) -> None:
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url, api_key="wrong-" + "x" * 20, max_retries=0).models.list()
    bare = httpx.get(f"{server.url}/models", timeout=SAFETY_S)
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"


def test_errors_are_openai_json(client: openai.OpenAI, server: Any, gen: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(
            model=server.model_id, messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=3
        )
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="another-model", prompt="x")
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=server.model_id, prompt=[5] * gen.max_model_len)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=server.model_id, prompt="x", temperature=-1)
    big = httpx.post(
        f"{server.url}/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": server.model_id, "prompt": "x" * 70_000},
        timeout=SAFETY_S,
    )
    assert big.status_code == 413 and "max_body_bytes" in big.json()["error"]["message"]
    auth = {"Authorization": f"Bearer {KEY}"}
    nowhere = httpx.get(f"{server.url}/no-such-route", headers=auth, timeout=SAFETY_S)
    assert nowhere.status_code == 404 and "error" in nowhere.json()
    garbled = httpx.post(f"{server.url}/completions", headers=auth, content=b"{not json", timeout=SAFETY_S)
    assert garbled.status_code == 400 and garbled.json()["error"]["type"] == "invalid_request_error"
    no_model = httpx.post(f"{server.url}/completions", headers=auth, json={"prompt": "x"}, timeout=SAFETY_S)
    assert no_model.status_code == 400 and "model" in no_model.json()["error"]["message"]


def test_a_backend_without_async_is_refused() -> None:
    with rollgen.create_generation(tiny_config("example", max_new_tokens=2)) as example:
        with pytest.raises(UnsupportedCapability, match="'async'"):
            rollgen.serve(example, api_key=KEY).__enter__()


def test_the_port_listens_once_start_returns(gen: Any) -> None:
    """A client may connect as soon as ``serve`` returns (uvicorn's lifespan startup, where the
    server says it is ready, comes before uvicorn listens: the server listens itself first)."""
    with rollgen.serve(gen, api_key=KEY) as s:
        socket.create_connection(("127.0.0.1", s.port), timeout=5).close()
        assert (
            httpx.get(
                f"{s.url}/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=SAFETY_S
            ).status_code
            == 200
        )


def test_auth_off_only_on_loopback(gen: Any) -> None:
    with pytest.raises(ConfigError, match="loopback"):
        rollgen.serving.Server(gen, host="0.0.0.0", require_api_key=False)
    with rollgen.serve(gen, require_api_key=False) as open_server:
        assert httpx.get(f"{open_server.url}/models", timeout=SAFETY_S).status_code == 200
    generated = rollgen.serving.Server(gen)
    assert generated.api_key and len(generated.api_key) >= 32


def test_shutdown_and_limits_answer_503_and_429(client: openai.OpenAI, server: Any, gen: Any) -> None:
    ask = {"model": server.model_id, "prompt": PROMPT, "max_tokens": 2}
    auth = {"Authorization": f"Bearer {KEY}"}
    with rollgen.serve(gen, api_key=KEY, front="thread") as inside:  # its state is reached here
        inside.state.closing = True  # as while the server stops
        closing = httpx.post(f"{inside.url}/completions", headers=auth, json=ask, timeout=SAFETY_S)
    assert closing.status_code == 503 and closing.json()["error"]["code"] == "server_shutting_down"
    with rollgen.serve(gen, api_key=KEY, limits=Limits(max_concurrent_requests=0)) as full:
        crowded = httpx.post(f"{full.url}/completions", headers=auth, json=ask, timeout=SAFETY_S)
    assert crowded.status_code == 429 and "max_concurrent_requests" in crowded.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="n=1"):
        client.completions.create(**ask, n=2, extra_body={"session_id": "two"})


def test_the_remote_backend_refuses_a_server_that_serves_another_config(server: Any) -> None:
    processed = tiny_config("hf", max_new_tokens=2, logprobs_mode="processed")
    with rollgen.create_generation(processed) as other, rollgen.serve(other, api_key=KEY) as elsewhere:
        config = tiny_config("remote", remote_cfg={"url": elsewhere.url, "api_key": KEY})
        with pytest.raises(ConfigError, match="returns processed logprobs"):
            rollgen.create_generation(config)
    wrong_key = tiny_config("remote", remote_cfg={"url": server.url, "api_key": "x" * 20})
    with pytest.raises(rollgen.WorkerError, match="401"):
        rollgen.create_generation(wrong_key)


def test_idle_connections_are_dropped_by_the_client_before_the_server(server: Any) -> None:
    """A request sent on a kept-alive connection as the server closes it is lost ("Server
    disconnected without sending a response"): so the server keeps idle connections longer than
    httpx clients (the openai SDK's among them) reuse them, and the remote backend stops reusing
    one before a uvicorn server's default 5 s."""
    import uvicorn

    from rollgen.serving.front import KEEP_ALIVE_S
    from rollgen_remote.generation import KEEPALIVE_EXPIRY_S

    assert KEEP_ALIVE_S > httpx.Limits().keepalive_expiry
    assert KEEPALIVE_EXPIRY_S < uvicorn.Config(app=None).timeout_keep_alive
    config = tiny_config("remote", remote_cfg={"url": server.url, "api_key": KEY})
    with rollgen.create_generation(config) as remote:
        assert remote._http._transport._pool._keepalive_expiry == KEEPALIVE_EXPIRY_S


def test_a_client_that_leaves_has_its_work_cancelled() -> None:
    """``unless_disconnected`` with a stand-in request whose client has gone (a real client's
    disconnect lands at a moment no test can fix): the work is cancelled, None returned."""
    from rollgen.serving.app import unless_disconnected

    class Gone:
        async def receive(self) -> dict[str, str]:
            return {"type": "http.disconnect"}

    async def run() -> tuple[Any, bool]:
        never = asyncio.Event()
        work = asyncio.ensure_future(never.wait())
        answer = await unless_disconnected(Gone(), work)  # type: ignore[arg-type]
        await asyncio.sleep(0)  # let the cancellation land
        return answer, work.cancelled()

    assert asyncio.run(run()) == (None, True)


class Recording:
    """The generation, with each rollout its ``submit`` makes and each ``cancel`` of one kept."""

    def __init__(self, gen: Any) -> None:
        self.gen, self.rollouts, self.cancelled = gen, [], []

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        rollout = self.gen.submit(*args, **kwargs)
        cancel = rollout.cancel

        def kept(*a: Any) -> None:
            self.cancelled.append(rollout)
            cancel(*a)

        rollout.cancel = kept
        self.rollouts.append(rollout)
        return rollout


def test_submits_queue_behind_a_busy_generation_and_a_left_request_is_cancelled(gen: Any) -> None:
    """The server's submits run on one thread of their own: while the generation is busy (its
    lock held, as a refit holds it) requests queue; each gets its own rollout, in order; one
    whose asker left meanwhile has its rollout cancelled; a bad request gets its typed error."""
    from rollgen.errors import InputError
    from rollgen.serving.port import Samples, Submitter

    recording = Recording(gen)
    submitter = Submitter(recording)  # type: ignore[arg-type]
    samples = Samples(prompt=tuple(gen.tokenizer("count: 1 2")["input_ids"]), n=1, max_new_tokens=4)

    async def run() -> list[Any]:
        with gen._lock:  # the generation busy: nothing is submitted yet
            kept = asyncio.ensure_future(submitter.submit(samples, None, False))
            left = asyncio.ensure_future(submitter.submit(samples, None, False))
            bad = asyncio.ensure_future(submitter.submit(Samples((1, 2), 1, temperature=-1.0), None, False))
            await asyncio.sleep(0)  # all three queued
            left.cancel()
            assert recording.rollouts == []
        rollout = await kept
        with pytest.raises(InputError, match="temperature"):
            await bad
        submitter.close()  # every queued request is submitted and handed back
        await asyncio.sleep(0)
        return [r async for r in rollout]

    results = asyncio.run(run())
    assert len(recording.rollouts) == 2 and recording.cancelled == [recording.rollouts[1]]
    assert len(results) == 1 and results[0].token_ids


class EchoParser:
    """A plugin's parser for the test: every reply is one call of ``echo`` with its text."""

    def parse(self, text: str) -> tuple[str, list[Any]]:
        from rollgen.serving import ToolCall

        return "", [ToolCall("echo", json.dumps({"text": text}))]


class EchoPlugin:
    @rollgen.hookimpl
    def rollgen_register_tool_parsers(self, register: Any) -> None:
        register("echo", EchoParser)


def test_a_plugins_tool_parser_turns_replies_into_tool_calls(gen: Any) -> None:
    """A parser a plugin registers, chosen by name: the SDK reads the calls, a stop becomes
    ``tool_calls``, and the tool's answer continues the session."""
    from rollgen.registry import get_registry

    plugin = EchoPlugin()
    get_registry().pm.register(plugin, name="echo-parser")
    try:
        assert "echo" in rollgen.serving.tool_parsers()
        with rollgen.serve(gen, api_key=KEY, tool_parser="echo") as server:
            client = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)
            tools: Any = [{"type": "function", "function": {"name": "echo"}}]
            messages: list[Any] = [{"role": "user", "content": PROMPT}]
            done = client.chat.completions.create(
                model=server.model_id,
                messages=messages,
                tools=tools,
                temperature=0,
                max_tokens=4,
                extra_body={"session_id": "tools"},
            )
            (choice,) = done.choices
            (call,) = choice.message.tool_calls or []
            assert call.function.name == "echo" and "text" in json.loads(call.function.arguments)  # type: ignore[union-attr]
            stopped = ext(choice)["stop_reason"] in ("eos", "stop_token", "stop_string")
            assert choice.finish_reason == ("tool_calls" if stopped else "length")
            messages += [
                choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "echoed"},
            ]
            after = client.chat.completions.create(
                model=server.model_id,
                messages=messages,
                tools=tools,
                temperature=0,
                max_tokens=4,
                extra_body={"session_id": "tools"},
            )
            seen = ext(choice)["prompt_token_ids"] + ext(choice)["token_ids"]
            assert ext(after.choices[0])["prompt_token_ids"][: len(seen)] == seen
    finally:
        get_registry().pm.unregister(plugin)


def test_stop_strings_end_the_text_before_them(client: openai.OpenAI, server: Any, gen: Any) -> None:
    plain = client.completions.create(model=server.model_id, prompt=PROMPT, temperature=0, max_tokens=8)
    text = plain.choices[0].text
    assert text.strip(), "the greedy continuation has text to stop in"
    stop = text.strip()[-1]
    cut = client.completions.create(
        model=server.model_id, prompt=PROMPT, temperature=0, max_tokens=8, stop=[stop]
    )
    (choice,) = cut.choices
    assert choice.text == text[: text.index(stop)]
    assert ext(choice)["stop_reason"] == "stop_string" and choice.finish_reason == "stop"
    kept = gen.tokenizer.decode(ext(choice)["token_ids"], skip_special_tokens=True)
    assert stop in kept, "the token ids keep the stop string"


def test_a_request_waits_for_the_trainer_then_gets_503(gen: Any) -> None:
    """While the trainer holds the generation (here its lock, held as a long refit holds it) or
    has put it to sleep, a request waits ``submit_timeout_s``, then gets 503 with
    ``Retry-After``; the server serves on."""
    ask = {"model": None, "prompt": PROMPT, "max_tokens": 2}
    auth = {"Authorization": f"Bearer {KEY}"}
    with rollgen.serve(gen, api_key=KEY, limits=Limits(submit_timeout_s=5.0)) as patient:
        ask["model"] = patient.model_id
        gen.finish_generation()
        try:
            asleep = httpx.post(f"{patient.url}/completions", headers=auth, json=ask, timeout=60)
        finally:
            gen.prepare_for_generation()
        assert asleep.status_code == 503 and asleep.headers["retry-after"] == "1", asleep.text
        message = asleep.json()["error"]["message"]
        assert "prepare_for_generation" in message and "submit_timeout_s" in message, message
        with gen._lock:
            busy = httpx.post(f"{patient.url}/completions", headers=auth, json=ask, timeout=60)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1", busy.text
        assert "busy" in busy.json()["error"]["message"]
        assert httpx.post(f"{patient.url}/completions", headers=auth, json=ask, timeout=60).status_code == 200


def test_a_request_that_comes_while_asleep_is_answered_once_awake(
    gen: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request to a sleeping generation waits for the trainer's ``prepare_for_generation``
    (the status endpoint counts it as waiting), then is answered as any other; one still
    waiting when the server stops gets 503 then."""
    auth = {"Authorization": f"Bearer {KEY}"}
    answers: list[httpx.Response] = []
    with rollgen.serve(gen, api_key=KEY) as server:
        ask = {"model": server.model_id, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
        entered = asleep_until_released(gen, monkeypatch)
        request = threading.Thread(
            target=lambda: answers.append(
                httpx.post(f"{server.url}/completions", headers=auth, json=ask, timeout=120)
            )
        )
        try:
            request.start()
            assert entered.wait(60), "the request did not wait for the generation"
            status = httpx.get(f"{server.url}/rollgen/status", headers=auth, timeout=SAFETY_S).json()
        finally:
            gen.prepare_for_generation()
        request.join()
    assert status["requests_waiting"] == 1 and status["requests_running"] == 1, status
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"][0]["rollgen"]["token_ids"]) == 2

    entered.clear()
    answers.clear()
    gen.finish_generation()
    try:
        with rollgen.serve(gen, api_key=KEY) as server:
            ask["model"] = server.model_id
            request = threading.Thread(
                target=lambda: answers.append(
                    httpx.post(f"{server.url}/completions", headers=auth, json=ask, timeout=120)
                )
            )
            request.start()
            assert entered.wait(60), "the request did not wait for the generation"
        request.join()  # the server stopped with the request waiting
    finally:
        gen.prepare_for_generation()
    (stopped,) = answers
    assert stopped.status_code == 503 and stopped.json()["error"]["code"] == "server_shutting_down", (
        stopped.text
    )


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40), cuts=st.lists(st.integers(1, 12), min_size=40, max_size=40))
@example(text="\ufffd", cuts=[1] * 40)  # a literal replacement character: held back as a part
@example(text="a\ufffd", cuts=[1] * 40)
def test_streamed_text_is_the_whole_text(gen: Any, text: str, cuts: list[int]) -> None:
    """Both incremental decoders (the fast tokenizer's own, and windowed decodes for any
    tokenizer), fed a reply's tokens in any pieces, give its whole text, up to a last run of
    replacement characters (which may be a character's first bytes: held back); a streamed
    choice's end sends that rest from the whole answer's text."""
    from rollgen.rollout import SampleResult, TokenDelta
    from rollgen.serving.streaming import ChoiceStream, IncrementalText, StreamedText

    tok = gen.tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    whole = tok.decode(ids, skip_special_tokens=True)
    for decoder in (StreamedText(tok.backend_tokenizer), IncrementalText(lambda i: tok.decode(list(i)))):
        stream = ChoiceStream(0, (1,), decoder, 0, False, False, str, "raw")
        shown, at = "", 0
        for cut in cuts:
            part = tuple(ids[at : at + cut])
            shown += stream.delta(TokenDelta(0, at, part, (0.0,) * len(part), 0))["text"]
            at += cut
        assert whole.startswith(shown) and not whole[len(shown) :].strip("\ufffd"), type(decoder).__name__
        result = SampleResult(0, ids, [0.0] * len(ids), "length", ((0, 0),))
        shown += stream.end(result, {"text": whole, "finish_reason": "length"})["text"]
        assert shown == whole, type(decoder).__name__
