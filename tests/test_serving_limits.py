"""``rollgen serve`` against hostile clients and a policy's own output: every bad input is a 400
naming the field, bodies and headers and connections are bounded, the key is checked before a
body is read, work that grows with a request runs off the event loop, sessions are kept only
once a turn of them is, and the tool parser is linear in the reply."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rollgen
from rollgen.errors import ConfigError
from rollgen.serving import HermesToolParser, Limits
from rollgen.testing import tiny_config
from tests.waiting import SAFETY_S, asleep_until_released, wait_until

KEY = "limits-key-" + "0" * 24
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def gen() -> Iterator[Any]:
    with rollgen.create_generation(tiny_config("hf", max_new_tokens=4, seed=0)) as g:
        yield g


@pytest.fixture(scope="module")
def server(gen: Any) -> Iterator[Any]:
    with rollgen.serve(gen, api_key=KEY, limits=Limits(max_sessions=3, max_body_bytes=64 * 1024)) as s:
        yield s


def post(server: Any, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", headers=AUTH, json=body, timeout=SAFETY_S)


def bad_request(answer: httpx.Response, *named: str) -> str:
    assert answer.status_code == 400, answer.text
    message = str(answer.json()["error"]["message"])
    for name in named:
        assert name in message, message
    return message


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("max_tokens", 2**63, "max_tokens"),
        ("max_tokens", 10**30, "max_tokens"),
        ("temperature", 1e300, "temperature"),
        ("top_k", 2**40, "top_k"),
        ("prompt", [2**63], "prompt"),
        ("seed", 2**63 - 1, "seed"),
        ("session_id", "agent/episode-1", "session id holds"),
        ("n", 10**6, "n"),
    ],
)
def test_out_of_range_fields_are_a_400_naming_them(server: Any, field: str, value: Any, named: str) -> None:
    body = {"model": server.model_id, "prompt": "count: 1", "n": 2, field: value}
    bad_request(post(server, "/completions", body), named)


def test_text_that_is_not_unicode_is_a_400(server: Any) -> None:
    def raw(path: str, body: str) -> httpx.Response:  # JSON's escapes allow what no encoder writes
        return httpx.post(
            f"{server.url}{path}",
            headers={**AUTH, "content-type": "application/json"},
            content=body.replace("MODEL", server.model_id).encode(),
            timeout=SAFETY_S,
        )

    bad_request(
        raw("/completions", '{"model": "MODEL", "prompt": "count: \\ud800 1"}'), "prompt", "surrogate"
    )
    chat = '{"model": "MODEL", "messages": [{"role": "user", "content": "\\udfff"}]}'
    bad_request(raw("/chat/completions", chat), "messages[0].content")


def test_messages_the_template_cannot_render_are_a_400(server: Any, gen: Any) -> None:
    malformed = {
        "model": server.model_id,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "name": "f"}]},
        ],
    }
    bad_request(post(server, "/chat/completions", malformed), "tool_calls", "function")
    with rollgen.serve(gen, api_key=KEY, front="thread") as inside:  # its tokenizer is reached here
        inside.state.served.tokenizer.chat_template = "{{ raise_exception('no tools here') }}"
        message = bad_request(
            post(inside, "/chat/completions", {"model": inside.model_id, "messages": [{"role": "user"}]})
        )
    assert "chat template" in message and "no tools here" in message


def test_session_ids_round_trip_or_are_refused(server: Any) -> None:
    sid = "run.7:episode-1@worker~2"
    done = post(server, "/completions", {"model": server.model_id, "prompt": "count: 1", "session_id": sid})
    assert done.status_code == 200, done.text
    assert httpx.get(f"{server.url}/sessions/{sid}", headers=AUTH, timeout=SAFETY_S).json()["id"] == sid
    for dots in (".", ".."):  # clients resolve these away in a URL: never an id
        refused = post(server, "/completions", {"model": server.model_id, "prompt": "1", "session_id": dots})
        bad_request(refused, "session id holds", "other than . or ..")
    for bad in ("a%2Fb", "a b", "é"):
        refused = httpx.get(f"{server.url}/sessions/{bad}", headers=AUTH, timeout=SAFETY_S)
        assert refused.status_code == 400 and "session id holds" in refused.text, (bad, refused.text)
    assert httpx.delete(f"{server.url}/sessions/{sid}", headers=AUTH, timeout=SAFETY_S).status_code == 200


def test_a_first_turn_that_fails_leaves_no_session(server: Any, gen: Any) -> None:
    """A first turn refused after its session was taken (its prompt too long for the context)
    leaves nothing behind: failed first turns never fill ``max_sessions`` (3 here)."""
    too_long = [5] * gen.max_model_len
    for i in range(5):
        refused = post(
            server,
            "/completions",
            {"model": server.model_id, "prompt": too_long, "session_id": f"failed-{i}"},
        )
        bad_request(refused, "max_model_len")
        assert (
            httpx.get(f"{server.url}/sessions/failed-{i}", headers=AUTH, timeout=SAFETY_S).status_code == 404
        )
    status = httpx.get(f"{server.url}/rollgen/status", headers=AUTH, timeout=SAFETY_S).json()
    assert status["sessions"] == 0, status
    kept = [f"kept-{i}" for i in range(3)]
    for sid in kept:
        ok = post(server, "/completions", {"model": server.model_id, "prompt": "count: 1", "session_id": sid})
        assert ok.status_code == 200, ok.text
    for sid in kept:
        httpx.delete(f"{server.url}/sessions/{sid}", headers=AUTH, timeout=SAFETY_S)


def test_the_key_is_checked_before_the_body_is_read(server: Any) -> None:
    """A request without the key whose body never comes is answered 401 at once."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=SAFETY_S) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 1000\r\n\r\n{"
        )
        assert read_answer(sock).startswith(b"HTTP/1.1 401")


def test_a_chunked_body_over_the_limit_is_a_413(server: Any) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(8):
            yield b" " * 16 * 1024

    answer = httpx.post(f"{server.url}/completions", headers=AUTH, content=chunks(), timeout=SAFETY_S)
    assert answer.status_code == 413 and "max_body_bytes" in answer.text


def read_answer(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (the test's safety net aside)."""
    sock.settimeout(SAFETY_S)
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


def test_slow_clients_are_cut_off(gen: Any) -> None:
    """A connection whose request never arrives, or whose body stops, is answered 408 and
    closed after ``client_timeout_s``; the server serves on."""
    with rollgen.serve(gen, api_key=KEY, limits=Limits(client_timeout_s=0.5)) as strict:
        with socket.create_connection(("127.0.0.1", strict.port)) as silent:
            assert read_answer(silent).startswith(b"HTTP/1.1 408")
        with socket.create_connection(("127.0.0.1", strict.port)) as partial:
            partial.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
            assert read_answer(partial).startswith(b"HTTP/1.1 408")
        with socket.create_connection(("127.0.0.1", strict.port)) as trickle:
            trickle.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer "
                + KEY.encode()
                + b"\r\ncontent-length: 100\r\n\r\n{"
            )
            answer = read_answer(trickle)
            assert answer.startswith(b"HTTP/1.1 408") and b"client_timeout_s" in answer
        wait_until(  # a client slower than client_timeout_s between its connect and its request gets 408
            lambda: httpx.get(f"{strict.url}/models", headers=AUTH, timeout=SAFETY_S).status_code == 200,
            "the server serves on",
        )


def request_bytes(path: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST /v1{path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


def test_a_client_that_stops_reading_stays_on_its_deadline_when_it_sends_another_request(
    gen: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that takes no answer bytes loses its connection ``client_timeout_s`` later, also
    when it then sends a next request on it: that request's arrival used to disarm the
    not-reading deadline, and the connection and its request were held for ever. (The deadline
    is long here, and fired by the test once seen armed: nothing waits on the clock.)"""
    listen = socket.socket.listen

    def small_buffers(sock: socket.socket, *args: Any) -> None:  # so that a few answers fill them
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        listen(sock, *args)

    monkeypatch.setattr(socket.socket, "listen", small_buffers)
    with rollgen.serve(gen, api_key=KEY, limits=Limits(client_timeout_s=600), front="thread") as strict:
        monkeypatch.undo()
        state = strict._front._uvicorn.server_state
        big = {"model": strict.model_id, "prompt": [5] * 64, "n": 16, "max_tokens": 1}
        with socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect(("127.0.0.1", strict.port))
            wait_until(lambda: len(state.connections) == 1, "the server has the connection")
            (conn,) = state.connections
            for _ in range(64):  # answers it never reads, one at a time, until the writes pause
                served = state.total_requests
                client.sendall(request_bytes("/completions", big))
                wait_until(
                    lambda: (
                        state.total_requests > served  # noqa: B023 - read while this request is the last
                        or conn.flow.write_paused
                    ),
                    "the request was answered, or the writes paused",
                )
                if conn.flow.write_paused:
                    break
            assert conn.flow.write_paused, "the client's unread answers did not fill the buffers"
            cycle = conn.cycle
            client.sendall(request_bytes("/completions", {"model": strict.model_id, "prompt": [5, 6]}))
            wait_until(lambda: conn.cycle is not cycle, "the next request's headers were read")
            reading = conn._reading
            assert reading is not None and not reading.cancelled(), "the next request disarmed the deadline"
            conn.loop.call_soon_threadsafe(conn._not_reading)  # what the deadline does when it fires
            wait_until(lambda: not state.connections, "the connection was closed")


def test_connections_past_the_cap_are_refused_at_once(gen: Any) -> None:
    """With ``max_connections`` open (idle ones), the next connection gets 503 and is closed
    without waiting; once one closes, a request is served again."""
    with rollgen.serve(
        gen, api_key=KEY, limits=Limits(max_connections=3, max_concurrent_requests=3)
    ) as small:
        held = [socket.create_connection(("127.0.0.1", small.port)) for _ in range(3)]
        try:
            with socket.create_connection(("127.0.0.1", small.port)) as extra:
                answer = read_answer(extra)
            assert answer.startswith(b"HTTP/1.1 503") and b"max_connections" in answer
        finally:
            for sock in held:
                sock.close()
        deadline = time.monotonic() + SAFETY_S
        while True:  # the server sees the closes as its loop gets to them
            served = httpx.get(f"{small.url}/models", headers=AUTH, timeout=SAFETY_S)
            if served.status_code != 503 or time.monotonic() > deadline:
                break
        assert served.status_code == 200, served.text


def test_limits_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="client_timeout_s"):
        Limits(client_timeout_s=0)


def test_tokenizing_runs_off_the_event_loop(gen: Any) -> None:
    """While a prompt is being tokenized (here held in the tokenizer until the test lets it
    go), the server answers others: the work is on a text worker, not the event loop."""
    with rollgen.serve(gen, api_key=KEY, front="thread") as server:  # its tokenizer is reached here
        tokenizing_waits_for_no_one(server)


def tokenizing_waits_for_no_one(server: Any) -> None:
    served = server.state.served
    entered, release = threading.Event(), threading.Event()
    encode = served.encode

    def held(text: str) -> list[int]:
        entered.set()
        release.wait(3 * SAFETY_S)  # past the health check's own limit: a blocked loop fails it
        return encode(text)

    served.encode = held
    answers: list[httpx.Response] = []
    asking = threading.Thread(
        target=lambda: answers.append(
            post(server, "/completions", {"model": server.model_id, "prompt": "count: 1"})
        )
    )
    try:
        asking.start()
        assert entered.wait(SAFETY_S)
        health = httpx.get(f"{server.url.removesuffix('/v1')}/health", timeout=SAFETY_S)
        assert health.status_code == 200 and not release.is_set()
    finally:
        served.encode = encode
        release.set()
        asking.join()
    assert answers[0].status_code == 200


def test_the_openai_sdk_reads_a_session(server: Any) -> None:
    client = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)
    client.completions.create(model=server.model_id, prompt="count: 1", extra_body={"session_id": "sdk"})
    session = client.get("/sessions/sdk", cast_to=httpx.Response).json()
    assert session["id"] == "sdk" and any(session["loss_mask"])
    client.delete("/sessions/sdk", cast_to=httpx.Response)


# ---- the tool parser: linear, and as the regular expression it replaced ---------------------------
#: The parser's rule written as the regular expression it replaced (backtracking: quadratic on
#: "<tool_call>" and whitespace with no closing tag): the oracle on short texts.
RULE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def oracle(text: str) -> tuple[str, list[tuple[str, str]]]:
    calls: list[tuple[str, str]] = []

    def take(match: re.Match[str]) -> str:
        import json

        try:
            data = json.loads(match.group(1))
        except (ValueError, RecursionError):
            return match.group(0)
        if not (isinstance(data, dict) and isinstance(data.get("name"), str)):
            return match.group(0)
        args = data.get("arguments", {})
        calls.append((data["name"], args if isinstance(args, str) else json.dumps(args)))
        return ""

    rest = RULE.sub(take, text)
    return (rest.strip() if calls else text), calls


PIECES = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        " ",
        "\n",
        '{"name": "add", "arguments": {"a": 1}}',
        '{"name": "f"}',
        '{"name": 3}',
        "[[[",
        "{",
        "}",
        "text",
        "<tool_",
        "call>",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES, max_size=30).map("".join))
def test_the_tool_parser_reads_what_the_rule_reads(text: str) -> None:
    rest, calls = HermesToolParser().parse(text)
    assert (rest, [(c.name, c.arguments) for c in calls]) == oracle(text)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 200_000), st.sampled_from(["<tool_call>", "<tool_call>[", "<tool_call>{"]))
def test_the_tool_parser_takes_adversarial_replies(size: int, head: str) -> None:
    """Replies a policy can learn to write (an opening tag, then whitespace or nesting that
    never closes) are read as text; the time it takes is measured in benchmarks.tool_parsers."""
    for text in (head + " " * size, head + "[" * size + "</tool_call>", (head + " ") * (size // 12 + 1)):
        rest, calls = HermesToolParser().parse(text)
        assert calls == [] and rest == text


def test_a_request_id_is_taken_from_admission(gen: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``request_id`` is the request's from its admission, also while it waits for the
    generation to wake: a second request with it is a 400 (both were admitted, and the first to
    end unregistered the other), a cancel finds it, and once it ended the id is free again."""
    answers: list[httpx.Response] = []
    with rollgen.serve(gen, api_key=KEY) as served:
        ask = {"model": served.model_id, "prompt": "count: 1", "request_id": "job-7"}
        first = threading.Thread(target=lambda: answers.append(post(served, "/completions", ask)))
        entered = asleep_until_released(gen, monkeypatch)
        try:
            first.start()
            assert entered.wait(SAFETY_S), "the request did not wait for the generation"
            bad_request(post(served, "/completions", ask), "'job-7'", "in flight already")
            cancel = post(served, "/rollgen/cancel", {"request_id": "job-7"})
            assert cancel.status_code == 200 and cancel.json()["cancelled"], cancel.text
        finally:
            gen.prepare_for_generation()
        first.join()
        assert [a.status_code for a in answers] == [200], [a.text for a in answers]
        assert post(served, "/completions", ask).status_code == 200, "the id is free once its request ended"


def test_deletes_of_a_session_that_wait_for_its_turn_answer_once(
    gen: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two DELETEs of a session that wait for its turn in flight: one deletes it, the other is a
    404 (it was a 500: the second popped an id already gone)."""
    with rollgen.serve(gen, api_key=KEY, front="thread") as served:
        ask = {"model": served.model_id, "prompt": "count: 1", "session_id": "ep-1"}
        assert post(served, "/completions", ask).status_code == 200
        session = served.state.sessions.get("ep-1")
        answers: list[httpx.Response] = []
        turn = threading.Thread(target=lambda: post(served, "/completions", {**ask, "prompt": "count: 1 2"}))
        deletes = [
            threading.Thread(
                target=lambda: answers.append(
                    httpx.delete(f"{served.url}/sessions/ep-1", headers=AUTH, timeout=SAFETY_S)
                )
            )
            for _ in range(2)
        ]
        entered = asleep_until_released(gen, monkeypatch)
        try:
            turn.start()
            assert entered.wait(SAFETY_S), "the turn did not wait for the generation"
            for delete in deletes:
                delete.start()
            wait_until(lambda: len(session.lock._waiters or ()) == 2, "both deletes wait for the turn")
        finally:
            gen.prepare_for_generation()
        for thread in (turn, *deletes):
            thread.join()
    assert sorted(a.status_code for a in answers) == [200, 404], [a.text for a in answers]


def test_a_content_part_whose_text_is_not_text_is_a_400(server: Any) -> None:
    for text in (5, ["a"], {"a": 1}):
        body = {
            "model": server.model_id,
            "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
        }
        bad_request(post(server, "/chat/completions", body), "messages.0.content", "text")


def test_the_text_check_is_linear_in_the_body() -> None:
    """The unicode check of a request walks its JSON once, spelling out only the path of the
    string it refuses: a body of many values under a long key holds no copy of that key per value
    (it held one: 0.3 MB of body took 4 GB and 6.6 s, on the event loop)."""
    import tracemalloc

    from rollgen.serving.schemas import check_text

    body = {"k" * 100_000: ["a"] * 2_000}
    tracemalloc.start()
    try:
        check_text(body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 5_000_000, f"the check of a 0.1 MB body took {peak / 1e6:.0f} MB"
    with pytest.raises(ValueError, match=r"messages\[1\]\.content\[0\]\.text: not valid Unicode"):
        check_text({"messages": [{}, {"content": [{"text": "\ud800"}]}]})
    with pytest.raises(ValueError, match=r"extra \(a key\)"):
        check_text({"extra": {"\udfff": 1}})
