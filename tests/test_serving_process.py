"""``rollgen serve``'s HTTP side in a process of its own (the default): it is apart from the
trainer's, it ends with the trainer's, and when it dies the trainer's process keeps nothing of its
requests running and serves again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import psutil
import pytest

import rollgen
from rollgen.serving import Server
from rollgen.testing import tiny_config
from tests.waiting import SAFETY_S, wait_until

KEY = "process-key-" + "0" * 20


@pytest.fixture(scope="module")
def gen() -> Iterator[Any]:
    with rollgen.create_generation(tiny_config("hf", max_new_tokens=8)) as g:
        yield g


def test_the_http_side_runs_in_a_process_of_its_own(gen: Any) -> None:
    with rollgen.serve(gen, api_key=KEY) as server:
        pid = server.front_pid
        assert pid is not None and pid != os.getpid()
        assert psutil.Process(pid).ppid() == os.getpid()
        assert os.getsid(pid) != os.getsid(0)  # a Ctrl-C at the trainer's terminal does not reach it
        client = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)
        done = client.completions.create(model=server.model_id, prompt="count: 1 2", max_tokens=3)
        assert len(done.choices[0].model_extra["rollgen"]["token_ids"]) > 0
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_dead_server_process_leaves_nothing_running_in_the_trainer(gen: Any) -> None:
    """The HTTP side killed while a streamed request runs (or just after it ended, if the model
    stopped first): the trainer's process keeps nothing running for it, ``stop`` returns, and a
    new server on the same generation serves."""
    server = Server(gen, api_key=KEY).start()
    pid = server.front_pid
    assert pid is not None
    try:
        body = {"model": server.model_id, "prompt": "count: 1", "max_tokens": 1000, "stream": True}
        auth = {"Authorization": f"Bearer {KEY}"}
        with httpx.stream(
            "POST", f"{server.url}/completions", json=body, headers=auth, timeout=SAFETY_S
        ) as answer:
            lines = answer.iter_lines()
            first = next(lines)
            assert first.startswith("data: "), first
            os.kill(pid, signal.SIGKILL)
            try:
                for _ in lines:  # what came before the kill, then the cut (if it still ran)
                    pass
            except httpx.HTTPError:
                pass
        wait_until(lambda: not gen.samples_in_flight(), "the dead server's samples end in the trainer")
    finally:
        server.stop()
    with rollgen.serve(gen, api_key=KEY) as again:
        client = openai.OpenAI(base_url=again.url, api_key=KEY, max_retries=0)
        assert client.completions.create(model=again.model_id, prompt="count: 1", max_tokens=2).choices


def test_the_server_process_ends_with_the_trainers() -> None:
    """A trainer killed outright (no ``stop``): its server's process sees the pipe close and ends."""
    trainer = textwrap.dedent(
        f"""
        import threading, rollgen
        from rollgen.serving import Server
        from rollgen.testing import tiny_config
        gen = rollgen.create_generation(tiny_config("hf", max_new_tokens=4))
        server = Server(gen, api_key={KEY!r}).start()
        print(server.front_pid, flush=True)
        threading.Event().wait()
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", trainer], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        front = psutil.Process(int(proc.stdout.readline()))
        proc.kill()
        proc.wait(SAFETY_S)
        front.wait(SAFETY_S)  # psutil.TimeoutExpired if it outlives the trainer
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_bridge_keeps_nothing_of_an_ended_request(gen: Any) -> None:
    """The trainer's end of the pipe, driven as the server's process drives it: a submitted
    request's events, then its end; a cancel that crosses the end (the client left as the answer
    ended) is dropped, not kept for a request that will never come."""
    from multiprocessing import Pipe

    from rollgen.serving.bridge import Bridge
    from rollgen.serving.port import Samples

    ours, theirs = Pipe()
    bridge = Bridge(gen, theirs)
    bridge.start(("hello",))
    try:
        assert ours.poll(SAFETY_S) and ours.recv() == [("hello",)]
        tokens = tuple(gen.tokenizer("count: 1 2")["input_ids"])
        ours.send([("submit", 1, Samples(tokens, 1, max_new_tokens=3), None, False)])
        kinds = []
        while "done" not in kinds:
            assert ours.poll(SAFETY_S), f"no answer after {kinds}"
            kinds += [message[0] for message in ours.recv()]
        assert kinds[0] == "submitted" and "events" in kinds
        ours.send([("cancel", 1), ("live", 2)])  # the live question: the cancel has been read
        assert ours.poll(SAFETY_S) and ours.recv()[0][:2] == ("live", 2)
        # a submit cancelled in the same write (its asker left at once) is never submitted
        ours.send([("submit", 3, Samples(tokens, 1), None, False), ("cancel", 3)])
        assert ours.poll(SAFETY_S) and [m[:2] for m in ours.recv()] == [("refused", 3)]
        assert not gen.samples_in_flight()
        assert bridge._cancelled == set() and bridge._submitting == set() and bridge._rollouts == {}
    finally:
        ours.close()
        bridge.close()


def test_a_pipe_end_is_not_closed_under_its_reader() -> None:
    """``close`` while the reader waits on the other end: the descriptor stays open (closed,
    its number could go to a file opened meanwhile, which the reader would then read from: the
    next pipe's message lost, seen once in 50 runs of the serving tests on two busy cores, in
    the test below); it closes once the other end does and the reader has seen it."""
    import asyncio
    from multiprocessing import Pipe

    from rollgen.serving.bridge import PipeEnd

    ours, theirs = Pipe()
    loop = asyncio.new_event_loop()
    end = PipeEnd(theirs, "test-pipe")
    end.start(loop, lambda messages: None)
    try:
        end.close()
        assert not theirs.closed
        ours.close()
        wait_until(lambda: theirs.closed, "the pipe's end closes once its reader is done")
    finally:
        loop.close()


def test_the_trainer_unpickles_nothing_but_data_from_the_server(gen: Any, tmp_path: Any) -> None:
    """The server's process faces the network: a message from it that would build anything but
    plain data and ``Samples`` is refused, nothing of it runs, and the bridge takes the server
    for gone."""
    import pathlib
    import pickle
    from multiprocessing import Pipe

    from rollgen.serving.bridge import Bridge

    ran = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> Any:
            return (pathlib.Path.touch, (ran,))

    ours, theirs = Pipe()
    bridge = Bridge(gen, theirs)
    bridge.start(("hello",))
    try:
        assert ours.poll(SAFETY_S) and ours.recv() == [("hello",)]
        ours.send_bytes(pickle.dumps([("live", Payload())]))
        wait_until(lambda: bridge.stopped is not None, "the bridge takes the server for gone")
        assert not ran.exists()
    finally:
        ours.close()
        bridge.close()
