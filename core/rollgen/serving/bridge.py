"""Both ends of the pipe between the server's process and the trainer's: ``Bridge``, in the
trainer's process, serves the ``Port`` calls of ``RemotePort``, in the server's, on the
generation. The pipe is made by the trainer's process and handed to the server's process it
starts. The server's process trusts what the trainer's sends; the trainer's process, whose
peer faces the network, unpickles only plain data and ``Samples`` from it (``TrainerUnpickler``).

Messages are tuples, sent in lists of those ready at once (one write per event-loop turn). The
server's process asks ``("submit", id, Samples, replica, stream_tokens)``, ``("cancel", id)``,
``("ready", id, timeout_s)``, ``("live", id)``, and says ``("serving",)`` once it listens and
``("stopped", why)`` as it ends; the trainer's answers ``("submitted", id)`` or ``("refused", id,
error)``, then ``("events", id, [TokenDelta | SampleResult])`` and ``("done", id)`` or
``("failed", id, error)``; ``("ready", id, (ready, usable))``, ``("live", id, Live)``; and it
sends ``("setup", sys.path, pickled FrontSpec)`` first and ``("stop",)`` to end the server."""

from __future__ import annotations

import asyncio
import io
import itertools
import logging
import pickle
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from typing import Any

from rollgen.errors import EngineClosed, RollgenError
from rollgen.interface import GenerationInterface
from rollgen.serving.port import Events, Facts, Live, LocalPort, LocalRollout, Samples, live_of

logger = logging.getLogger(__name__)

#: How long a question about the generation's state (``live``) waits for the trainer's process.
ANSWER_TIMEOUT_S = 30.0
#: How long closing waits for a thread of the pipe's to end.
CLOSE_TIMEOUT_S = 10.0
Message = tuple[Any, ...]
#: What pickling a message may raise (an error of the caller's that cannot be pickled, ...).
UNPICKLABLE = (pickle.PicklingError, TypeError, AttributeError)


class TrainerUnpickler(pickle.Unpickler):
    """Reads the server's messages in the trainer's process: plain data and ``Samples`` only,
    so a server process taken over through its network side cannot run code in the trainer's."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("rollgen.serving.port", "Samples"):
            return Samples
        raise pickle.UnpicklingError(f"the server's process sent a {module}.{name}: refused")


def trainer_loads(data: bytes) -> Any:
    return TrainerUnpickler(io.BytesIO(data)).load()


def unsendable(message: Message, error: BaseException) -> Message:
    """What is sent instead of ``message`` when it cannot be pickled: its request fails."""
    failure = RollgenError(
        f"a {message[0]!r} message could not be sent between the server's processes: {error}"
    )
    return ("failed" if message[0] in ("events", "done", "failed") else "refused", message[1], failure)


class PipeEnd:
    """One end: ``post`` queues a message (from the event loop's thread), sent with the others
    of the same loop turn by a writer thread; a reader thread hands each list received to
    ``handle`` in the loop, and ``None`` once the other end is gone."""

    def __init__(self, conn: Connection, name: str, loads: Callable[[bytes], Any] = pickle.loads) -> None:
        self.conn, self.name, self.loads = conn, name, loads
        self._pending: list[Message] = []
        self._out: queue.SimpleQueue[list[Message] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        #: The threads still using ``conn``: the last to end closes it. A descriptor closed while
        #: another thread may still read or write it can be reused by a file opened meanwhile,
        #: which that thread would then read from or write to.
        self._users = 0
        self._users_lock = threading.Lock()

    def start(self, loop: asyncio.AbstractEventLoop, handle: Callable[[list[Message] | None], None]) -> None:
        self._loop = loop

        def read() -> None:
            try:
                while True:
                    try:
                        messages = self.loads(self.conn.recv_bytes())
                    except (EOFError, OSError):
                        messages = None
                    except Exception:  # noqa: BLE001 - a message that cannot be read ends the pipe
                        logger.exception(
                            "%s: a message from the other end could not be read; closing", self.name
                        )
                        messages = None
                    try:
                        loop.call_soon_threadsafe(handle, messages)
                    except RuntimeError:  # the loop is closed: nobody reads any more
                        return
                    if messages is None:
                        return
            finally:
                self._let_go_of_conn()

        def write() -> None:
            try:
                while (messages := self._out.get()) is not None:
                    try:
                        self._send(messages)
                    except (OSError, ValueError):  # the other end is gone: its reader says so
                        return
            finally:
                self._let_go_of_conn()

        self._users = 2
        for target, role in ((read, "read"), (write, "write")):
            thread = threading.Thread(target=target, name=f"{self.name}-{role}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _send(self, messages: list[Message]) -> None:
        try:
            self.conn.send(messages)
        except UNPICKLABLE:  # nothing was written: send them one by one, each that fails as a failure
            for message in messages:
                try:
                    self.conn.send([message])
                except UNPICKLABLE as exc:
                    logger.error("%s: a %r message cannot be pickled: %s", self.name, message[0], exc)
                    self.conn.send([unsendable(message, exc)])

    def post(self, message: Message) -> None:
        if not self._pending and self._loop is not None:
            self._loop.call_soon(self._flush)
        self._pending.append(message)

    def _flush(self) -> None:
        messages, self._pending = self._pending, []
        if messages:
            self._out.put(messages)

    def _let_go_of_conn(self) -> None:
        with self._users_lock:
            self._users -= 1
            last = self._users == 0
        if last:
            self.conn.close()

    def close(self, last: Message | None = None) -> None:
        """Stop writing (what was posted is sent first, then ``last``); this end closes once its
        reader has read the other end's close too (or now, if it never started)."""
        self._flush()
        writer = [t for t in self._threads if t.name.endswith("-write")]
        if last is not None:
            if writer:
                self._out.put([last])
            else:
                try:
                    self.conn.send([last])
                except (OSError, ValueError, *UNPICKLABLE):
                    logger.debug("%s: the other end is gone", self.name)
        self._out.put(None)
        for thread in writer:
            thread.join(CLOSE_TIMEOUT_S)
            if thread.is_alive():
                logger.warning("%s: the pipe's writer did not end within %g s", self.name, CLOSE_TIMEOUT_S)
        if not self._threads:
            self.conn.close()


class Bridge:
    """The trainer's end: the server process's requests run on ``gen`` (through a
    ``LocalPort``), in an event loop of its own thread, never the caller's."""

    def __init__(self, gen: GenerationInterface, conn: Connection) -> None:
        self.port = LocalPort(gen)
        self.pipe = PipeEnd(conn, "rollgen-serve-bridge", trainer_loads)
        self.serving = threading.Event()
        #: Why the server's process stopped, once it has (None while it runs).
        self.stopped: str | None = None
        self._loop = asyncio.new_event_loop()
        self._rollouts: dict[int, LocalRollout] = {}
        self._submitting: set[int] = set()
        self._cancelled: set[int] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        #: The server's process is gone (or the bridge closes): a rollout submitted now is cancelled.
        self._gone = False
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="rollgen-serve-bridge", daemon=True
        )

    def start(self, first: Message) -> None:
        """Serve the pipe, sending ``first`` before anything else."""
        self._thread.start()
        self.pipe.start(self._loop, self._handle)
        self._loop.call_soon_threadsafe(self.pipe.post, first)

    def stop_server(self) -> None:
        """Ask the server's process to stop (it lets the requests in flight end first)."""
        self._loop.call_soon_threadsafe(self.pipe.post, ("stop",))

    def close(self) -> None:
        """Cancel what still runs, close the pipe and the loop (once the server's process ended)."""

        async def end() -> None:
            self._let_go()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._loop.stop()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(end(), self._loop)
            self._thread.join(ANSWER_TIMEOUT_S)
            if self._thread.is_alive():
                logger.warning("the serving bridge's loop did not end within %g s", ANSWER_TIMEOUT_S)
                return
        self.pipe.close()
        self._loop.close()
        self.port.close()

    # ---- in the bridge's loop --------------------------------------------------------------------
    def _handle(self, messages: list[Message] | None) -> None:
        if messages is None:  # the server's process is gone: nobody reads its requests' answers
            self.stopped = self.stopped or "the server's process ended"
            self.serving.set()
            self._let_go()
            return
        for message in messages:
            kind = message[0]
            if kind == "submit":
                self._submitting.add(message[1])  # a cancel in the same write finds it
                self._spawn(self._submit(*message[1:]))
            elif kind == "cancel":
                self._cancel(message[1])
            elif kind == "ready":
                self._spawn(self._ready(*message[1:]))
            elif kind == "live":
                self.pipe.post(("live", message[1], live_of(self.port.gen)))
            elif kind == "serving":
                self.serving.set()
            elif kind == "stopped":
                self.stopped = message[1]
                self.serving.set()

    def _let_go(self) -> None:
        """No one reads the requests' answers any more: cancel their rollouts, and any submitted later."""
        self._gone = True
        for rollout in self._rollouts.values():
            rollout.cancel()

    def _spawn(self, work: Any) -> None:
        task = self._loop.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _cancel(self, rid: int) -> None:
        rollout = self._rollouts.get(rid)
        if rollout is not None:
            rollout.cancel()
        elif rid in self._submitting:  # cancelled once it is submitted (an ended one: nothing to do)
            self._cancelled.add(rid)

    async def _submit(self, rid: int, samples: Samples, replica: int | None, stream_tokens: bool) -> None:
        if rid in self._cancelled or self._gone:  # its asker left before it was submitted
            self._submitting.discard(rid)
            self._refused(rid, EngineClosed("cancelled before it was submitted"))
            return
        try:
            rollout = await self.port.submit(samples, replica, stream_tokens)
        except RollgenError as exc:
            self._refused(rid, exc)
            return
        except Exception as exc:  # noqa: BLE001 - a backend's bug: that request's 500 names it
            logger.exception("submit of a served request failed")
            self._refused(rid, RollgenError(f"submit failed: {type(exc).__name__}: {exc}"))
            return
        finally:
            self._submitting.discard(rid)
        self._rollouts[rid] = rollout
        if rid in self._cancelled or self._gone:
            self._cancelled.discard(rid)
            rollout.cancel()
        self.pipe.post(("submitted", rid))
        try:
            async for batch in rollout.batches():
                self.pipe.post(("events", rid, batch))
            self.pipe.post(("done", rid))
        except RollgenError as exc:
            self.pipe.post(("failed", rid, exc))
        except Exception as exc:  # noqa: BLE001 - a backend's bug: that request's answer names it
            logger.exception("a served rollout failed")
            self.pipe.post(("failed", rid, RollgenError(f"the rollout failed: {type(exc).__name__}: {exc}")))
        finally:
            del self._rollouts[rid]

    def _refused(self, rid: int, error: RollgenError) -> None:
        self._cancelled.discard(rid)
        self.pipe.post(("refused", rid, error))

    async def _ready(self, wid: int, timeout_s: float) -> None:
        self.pipe.post(("ready", wid, await self.port.wait_ready(timeout_s)))


class RemoteRollout:
    """A rollout in the trainer's process, as the server's process reads it."""

    def __init__(self, port: RemotePort, rid: int) -> None:
        self.port, self.rid = port, rid
        self._ready: deque[Events] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._ended

    async def batches(self) -> AsyncIterator[Events]:
        while True:
            if self._ready:
                yield self._ready.popleft()
                continue
            if self._ended:
                if self._error is not None:
                    raise self._error
                return
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    def cancel(self) -> None:
        if not self._ended:
            self.port.pipe.post(("cancel", self.rid))

    def _add(self, batch: Events) -> None:
        self._ready.append(batch)
        self._wake()

    def _end(self, error: BaseException | None) -> None:
        self._ended, self._error = True, error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class RemotePort:
    """The server's end: the ``Port`` of a generation in the trainer's process. ``on_stop`` is
    called in the loop when the trainer asks the server to stop or its process is gone."""

    def __init__(self, conn: Connection, facts: Facts, on_stop: Callable[[], None]) -> None:
        self.facts = facts
        self.pipe = PipeEnd(conn, "rollgen-serve-port")
        self.on_stop = on_stop
        self._ids = itertools.count()
        self._answers: dict[int, asyncio.Future[Any]] = {}
        self._rollouts: dict[int, RemoteRollout] = {}
        self._gone = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.pipe.start(loop, self._handle)

    async def submit(self, samples: Samples, replica: int | None, stream_tokens: bool) -> RemoteRollout:
        rid = next(self._ids)
        rollout = RemoteRollout(self, rid)
        self._rollouts[rid] = rollout
        try:
            await self._ask(rid, ("submit", rid, samples, replica, stream_tokens), None)
        except BaseException as exc:
            self._rollouts.pop(rid, None)
            if isinstance(exc, asyncio.CancelledError) and not self._gone:
                self.pipe.post(("cancel", rid))  # its asker left: once submitted it is cancelled
            raise
        return rollout

    async def wait_ready(self, timeout_s: float) -> tuple[bool, bool]:
        wid = next(self._ids)
        ready: tuple[bool, bool] = await self._ask(
            wid, ("ready", wid, timeout_s), timeout_s + ANSWER_TIMEOUT_S
        )
        return ready

    async def live(self) -> Live:
        qid = next(self._ids)
        live: Live = await self._ask(qid, ("live", qid), ANSWER_TIMEOUT_S)
        return live

    async def _ask(self, key: int, message: Message, timeout_s: float | None) -> Any:
        """The answer to ``message``, within ``timeout_s`` (None: the caller bounds the wait)."""
        if self._gone:
            raise _gone()
        answer = asyncio.get_running_loop().create_future()
        self._answers[key] = answer
        self.pipe.post(message)
        try:
            return await asyncio.wait_for(answer, timeout_s)
        except asyncio.TimeoutError:
            raise EngineClosed(
                f"the trainer's process did not answer within {timeout_s:g} s (it may be stuck)"
            ) from None
        finally:
            self._answers.pop(key, None)

    def _handle(self, messages: list[Message] | None) -> None:
        if messages is None:
            self._gone = True
            for answer in self._answers.values():
                if not answer.done():
                    answer.set_exception(_gone())
            for rollout in self._rollouts.values():
                rollout._end(_gone())
            self._rollouts.clear()
            self.on_stop()
            return
        for message in messages:
            kind, key = message[0], message[1] if len(message) > 1 else -1
            reader = self._rollouts.get(key)
            if kind == "events":
                if reader is not None:
                    reader._add(message[2])
            elif kind in ("done", "failed"):
                if reader is not None:
                    del self._rollouts[key]
                    reader._end(message[2] if kind == "failed" else None)
            elif kind == "refused":
                self._answer(key, error=message[2])
            elif kind == "submitted":
                self._answer(key, None)
            elif kind in ("ready", "live"):
                self._answer(key, message[2])
            elif kind == "stop":
                self.on_stop()

    def _answer(self, key: Any, value: Any = None, error: BaseException | None = None) -> None:
        answer = self._answers.get(key)
        if answer is None or answer.done():
            return
        if error is not None:
            answer.set_exception(error)
        else:
            answer.set_result(value)


def _gone() -> EngineClosed:
    return EngineClosed("the trainer's process is gone (or stopped serving)")
