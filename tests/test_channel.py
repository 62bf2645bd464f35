"""Refit channels (``rollgen.refit.channel``): answers in order, errors brought back typed,
a rank whose process ended, ranks that do not connect; and the driver's use of them for kept
layouts (a name alone once an engine holds it, the pickle again for a rank that lost it, every
rank's answer before an error). Real vLLM refits over them in test_vllm.py and the suite."""

import multiprocessing
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch

from rollgen import auth
from rollgen.errors import RefitError, WorkerError
from rollgen.processes import running
from rollgen.refit import TensorMeta, WeightBucket, channel
from rollgen.refit.channel import Channel, ChannelServer, EngineChannels

CPU = torch.device("cpu")


def serve(handle: Any) -> Channel:
    key = os.urandom(16)
    return Channel(ChannelServer(handle, key, CPU).address, key, "engine rank 0")


def double(request: Any) -> Any:
    if request == "refit":
        raise RefitError("rejected on the rank", ["a problem"])
    if request == "bad":
        raise ValueError("a bug on the rank")
    return request * 2


def test_a_channel_answers_in_order_and_brings_errors_back_typed() -> None:
    ch = serve(double)
    for request in (1, 2, "refit", "bad", 3):
        ch.send(request)
    assert [ch.result(), ch.result()] == [2, 4]
    with pytest.raises(RefitError, match="rejected on the rank") as rejected:
        ch.result()
    assert rejected.value.problems == ["a problem"]
    with pytest.raises(WorkerError, match="engine rank 0: raised ValueError: a bug on the rank") as crashed:
        ch.result()
    assert "ValueError" in crashed.value.remote_traceback and not crashed.value.died
    assert ch.result() == 6  # still serving
    ch.close()


def _rank(conn: Any, key: bytes) -> None:
    server = ChannelServer(lambda _: threading.Event().wait(), key, CPU)  # never answers
    conn.send(server.address)
    threading.Event().wait()


def test_a_channel_whose_rank_process_ended_is_a_dead_worker() -> None:
    key = os.urandom(16)
    parent, child = multiprocessing.get_context("spawn").Pipe()
    rank = multiprocessing.get_context("spawn").Process(target=_rank, args=(child, key), daemon=True)
    rank.start()
    try:
        ch = Channel(parent.recv(), key, "rollgen-vllm-dp1 rank 0")
        ch.send("load")
    finally:
        rank.kill()
        rank.join()
    with pytest.raises(WorkerError, match="rollgen-vllm-dp1 rank 0: its refit channel closed") as info:
        ch.result()
    assert info.value.died
    ch.close()


def _owned_rank(conn: Any, key: bytes, owner: int) -> None:
    """A rank in a process below its engine's actor (``owner``), as vLLM's engine core runs."""

    def handle(request: Any) -> Any:
        if request == "end the owner":  # the actor dies while the rank loads
            os.kill(owner, signal.SIGKILL)
            while running(owner):
                time.sleep(0.01)
        if request == "hang":
            threading.Event().wait()
        return request

    server = ChannelServer(handle, key, CPU, owner=owner)
    conn.send((server.address, os.getpid()))
    threading.Event().wait()


def _owner(conn: Any, key: bytes) -> None:
    multiprocessing.get_context("fork").Process(target=_owned_rank, args=(conn, key, os.getpid())).start()
    threading.Event().wait()


def test_a_rank_that_outlives_its_engines_actor_answers_as_the_engines_death() -> None:
    """The rank's process outlives the actor it serves (Ray ends it only later): an update it
    handled as the actor died, and any request after, come back as the engine's death, never
    as applied or as the engine's error."""
    key = os.urandom(16)
    parent, child = multiprocessing.get_context("spawn").Pipe()
    owner = multiprocessing.get_context("spawn").Process(target=_owner, args=(child, key))
    owner.start()
    address, rank = parent.recv()
    try:
        first = Channel(address, key, "rollgen-vllm-dp1 rank 0")
        first.send("load")
        assert first.result() == "load"
        first.send("end the owner")
        with pytest.raises(WorkerError, match=f"dp1 rank 0: its engine's process {owner.pid} ended") as info:
            first.result()
        assert info.value.died and running(rank)
        second = Channel(address, key, "rollgen-vllm-dp1 rank 0")  # the rank still accepts
        second.send("hang")  # not handled: answered at once
        with pytest.raises(WorkerError, match="its engine's process") as info:
            second.result(timeout_s=30)
        assert info.value.died
        second.close()
    finally:
        owner.kill()
        owner.join()
        os.kill(rank, signal.SIGKILL)


def test_channels_open_to_every_rank_or_to_none() -> None:
    key = os.urandom(16)
    servers = [ChannelServer(double, key, CPU) for _ in range(3)]
    opened = channel.connect(
        [[servers[0].address, servers[1].address], [servers[2].address]], key, ["a", "b"]
    )
    assert [[c.name for c in engine] for engine in opened] == [["a rank 0", "a rank 1"], ["b rank 0"]]
    opened[1][0].send(5)
    assert opened[1][0].result() == 10
    channel.close(opened)
    unreachable = ChannelServer(double, key, CPU).address + "-elsewhere"
    assert channel.connect([[ChannelServer(double, key, CPU).address], [unreachable]], key, ["a", "b"]) == []


class Rank:
    """A stand-in engine rank for the driver's side: it keeps what it unpacked by layout, as
    ``refit.Receiver`` does, in a table of its own, and can be told to fail."""

    def __init__(self) -> None:
        self.kept: dict[str, Any] = {}
        self.requests: list[tuple[str, bool]] = []
        self.fail = False

    def handle(self, request: tuple[str, bytes | None]) -> bool:
        layout, data = request
        self.requests.append((layout, data is not None))
        if self.fail:
            raise RefitError("this rank's load failed")
        if data is None and layout not in self.kept:
            return False
        if data is not None:
            self.kept[layout] = pickle.loads(data)
        return True


def test_the_driver_sends_a_kept_layout_by_name_once_each_engine_holds_it() -> None:
    """Two engines of two ranks: the first refit of a layout carries its pickle, later ones the
    name alone; a rank that lost the layout gets the pickle next; an error on one rank is raised
    once every rank answered, so that the channels stay in step (the next refit's answers are
    its own)."""
    ranks = [Rank() for _ in range(4)]
    channels = [[serve(r.handle) for r in ranks[:2]], [serve(r.handle) for r in ranks[2:]]]
    bucket = WeightBucket("tensors", (TensorMeta("w", (2,), "float32"),), [torch.ones(2)], layout="L")
    engines = EngineChannels(channels)

    def refit() -> None:
        engines.send(bucket, lambda b, i: pickle.dumps(b))

    refit()
    refit()
    assert all(r.requests == [("L", True), ("L", False)] for r in ranks)
    del ranks[3].kept["L"]
    refit()
    assert ranks[3].requests[2:] == [("L", False), ("L", True)]
    assert all(r.requests[2:] == [("L", False)] for r in ranks[:3])
    ranks[0].fail = True
    with pytest.raises(RefitError, match="this rank's load failed"):
        refit()
    ranks[0].fail = False
    del ranks[3].kept["L"]
    refit()  # answers in step: rank 3's miss is its own, and it gets the pickle
    assert [r.requests[-1] for r in ranks] == [("L", False)] * 3 + [("L", True)]
    assert ranks[3].requests[-2] == ("L", False) and engines.channels is channels
    channel.close(channels)


def test_a_failure_before_or_while_sending_leaves_the_channels_in_step() -> None:
    """A pickle that cannot be made fails the refit before any rank is asked; a channel that
    closes while the driver sends (its engine died) ends the sending, every rank asked before it
    answers, and the engine's death is what the refit raises, before another rank's error."""
    ranks = [Rank() for _ in range(3)]
    channels = [[serve(r.handle)] for r in ranks]
    bucket = WeightBucket("tensors", (TensorMeta("w", (2,), "float32"),), [torch.ones(2)], layout="L")

    def no_pickle(b: WeightBucket, i: int) -> bytes:
        if i == 1:
            raise RuntimeError("cannot export this buffer")
        return pickle.dumps(b)

    with pytest.raises(RuntimeError, match="cannot export"):
        EngineChannels(channels).send(bucket, no_pickle)
    assert all(r.requests == [] for r in ranks)
    engines = EngineChannels(channels)
    engines.send(bucket, lambda b, i: pickle.dumps(b))
    assert all(r.requests == [("L", True)] for r in ranks)
    ranks[0].fail = True
    channels[1][0].close()  # as if its engine's process had ended
    with pytest.raises(WorkerError, match="engine rank 0: its refit channel closed") as died:
        engines.send(bucket, lambda b, i: pickle.dumps(b))
    assert died.value.died
    assert [len(r.requests) for r in ranks] == [2, 1, 1]  # rank 0, asked before, answered; not rank 2
    ranks[0].fail = False
    for ch in (channels[0][0], channels[2][0]):  # their next answers are their own
        ch.send(("L", None))
        assert ch.result() is True
    channel.close(channels)


def test_a_rank_that_does_not_answer_within_the_deadline_is_wedged() -> None:
    """A rank whose load never returns (a stand-in handler): ``result`` raises its death once
    the deadline (short here) has passed and closes its channel; the other ranks still answer
    first, and the refit raises the death."""
    ranks = [Rank(), Rank()]
    channels = [
        [serve(ranks[0].handle)],
        [serve(lambda _: threading.Event().wait())],
        [serve(ranks[1].handle)],
    ]
    bucket = WeightBucket("tensors", (TensorMeta("w", (2,), "float32"),), [torch.ones(2)], layout="L")
    with pytest.raises(
        WorkerError, match="did not answer over its refit channel within call_timeout_s=0.5"
    ) as wedged:
        EngineChannels(channels).send(bucket, lambda b, i: pickle.dumps(b), timeout_s=0.5)
    assert wedged.value.died
    assert all(r.requests == [("L", True)] for r in ranks)
    with pytest.raises(WorkerError, match="its refit channel closed"):
        channels[1][0].send(("L", None))
    channel.close(channels)


def test_an_answer_that_cannot_be_pickled_is_a_worker_error() -> None:
    ch = serve(lambda request: lambda: request)
    ch.send(1)
    with pytest.raises(WorkerError, match="its answer cannot be pickled") as info:
        ch.result()
    assert not info.value.died
    ch.send(2)
    with pytest.raises(WorkerError):
        ch.result()  # still answering
    ch.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_rank_thread_that_fails_before_it_accepts_leaves_no_channel() -> None:
    """A rank's thread that fails (here: a GPU that is not there) closes its socket, and the
    driver's connect fails at once instead of waiting on it."""
    key = os.urandom(16)
    good = ChannelServer(double, key, CPU)
    failing = ChannelServer(double, key, torch.device("cuda", 99))
    assert channel.connect([[good.address], [failing.address]], key, ["a", "b"]) == []
    failing._thread.join()  # its error is reported within this test


# ---- who may talk to a rank: same user, holding the key; nobody else holds anything up ------------


def _connect_within(address: str, key: bytes, seconds: float = 60.0) -> list[list[Channel]]:
    """``channel.connect`` from a thread, failing the test (not hanging it) if it never returns."""
    opened: list[list[list[Channel]]] = []
    thread = threading.Thread(
        target=lambda: opened.append(channel.connect([[address]], key, ["a"])), daemon=True
    )
    thread.start()
    thread.join(seconds)
    assert opened, f"the driver's connect did not return within {seconds} s"
    return opened[0]


def test_a_silent_client_holds_up_neither_the_driver_nor_the_rank() -> None:
    key = os.urandom(16)
    server = ChannelServer(double, key, CPU)
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(server.address)  # connects first, then never says a word
    opened = _connect_within(server.address, key)
    assert len(opened) == 1
    opened[0][0].send(21)
    assert opened[0][0].result() == 42
    channel.close(opened)
    silent.close()


def test_a_client_that_never_authenticates_is_dropped_after_the_handshake_timeout(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(channel, "HANDSHAKE_TIMEOUT_S", 0.2)
    server = ChannelServer(double, os.urandom(16), CPU)
    silent = socket.socket(socket.AF_UNIX)
    silent.settimeout(60)
    silent.connect(server.address)
    assert len(silent.recv(64)) == auth.NONCE_BYTES  # the rank's challenge, then nothing until it drops us
    assert silent.recv(64) == b""
    refused = "refused a connection: the peer did not authenticate within 0.2 s"
    assert any(refused in r.message for r in caplog.records)


def test_a_wrong_key_is_refused_at_warning_and_the_rank_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    key = os.urandom(16)
    server = ChannelServer(double, key, CPU)
    assert _connect_within(server.address, os.urandom(16)) == []
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and r.name == channel.__name__]
    assert any("failed its authentication" in r.message for r in warnings)
    opened = _connect_within(server.address, key)
    opened[0][0].send(1)
    assert opened[0][0].result() == 2
    channel.close(opened)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root, to connect as another user")
def test_another_user_is_refused_even_with_the_key() -> None:
    key = os.urandom(16)
    server = ChannelServer(double, key, CPU)
    as_nobody = (
        "import os, socket, sys; os.setgid(65534); os.setuid(65534); s = socket.socket(socket.AF_UNIX); "
        "s.connect('\\0' + sys.argv[1]); s.settimeout(30); print(len(s.recv(64)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", as_nobody, server.address[1:]], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "0", done.stderr  # dropped before any challenge
    opened = _connect_within(server.address, key)
    assert len(opened) == 1
    channel.close(opened)
