"""The OpenAI endpoint's cost: the same requests through ``rollgen.serve`` (driven by an aiohttp
load generator, one connection per request in flight) and through in-process ``submit`` (one
single-sample rollout per request; with ``--stream`` also submitted streaming its tokens, as the
server submits a streamed request), at each number of requests in flight. Per contestant: wall
time, generated tokens per second, the median and p99 time to a request's answer, the median time
to its first token (``--stream``: the first chunk, or in process the first ``TokenDelta``; not
streamed, the answer's time), and CPU seconds per request: the load generator's (``client``), the serving
process's (``server``: here the trainer's process, with rollgen's driver) and the rest of the
machine's (``other``: the engine's processes and anything else running). ``--clients N`` runs the
load in N processes of its own (0: in this process, beside the server). The GPU run against raw
``vllm serve`` is ``benchmarks/serve_gpu.py``, built on this module.

    python -m benchmarks.serve [--backend hf] [--config JSON] [--requests 64] [--in-flight 8,32]
        [--max-tokens 16] [--stream] [--clients 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import multiprocessing
import multiprocessing.connection
import signal
import statistics
import threading
import time
import traceback
import zlib
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import aiohttp
import psutil
import torch

import rollgen
from benchmarks.common import print_table, random_prompts, write_results
from rollgen.errors import RollgenError
from rollgen.rollout import TokenDelta
from rollgen.serving import Limits
from rollgen.testing.config import tiny_config

logger = logging.getLogger(__name__)

PROMPT_LEN = 8
#: Requests each load runs untimed first, per client (connections made, engine warm).
WARMUP = 16
#: The longest one request may take before the load fails.
REQUEST_TIMEOUT_S = 600.0
COLUMNS = [
    "contestant",
    "in_flight",
    "requests",
    "tokens_per_s",
    "tokens_per_request",
    "median_answer_s",
    "p99_answer_s",
    "median_ttft_s",
    "p99_ttft_s",
    "client_cpu_ms",
    "server_cpu_ms",
    "front_cpu_ms",
    "other_cpu_ms",
    "mean_running",
    "engine_calls",
]

#: One request's outcome: the tokens it generated and when (``time.perf_counter``) its first
#: token arrived.
Outcome = tuple[int, float]


def prompts(n: int, vocab: int, length: int = PROMPT_LEN, seed: int = 0) -> list[list[int]]:
    return [list(map(int, row)) for row in random_prompts(n, length, vocab, seed).tolist()]


def load_prompts(args: argparse.Namespace, vocab: int, kind: str, level: int, round_: int) -> list[list[int]]:
    """The prompts of one contestant's load at ``level`` in round ``round_``: with
    ``--same-prompts`` the same for every contestant (whose tokens can then be compared), else
    prompts of their own for each ``kind`` of load (the contestant's name), level and round, so
    that no load decodes from prefixes an earlier one left in the engine's prefix cache (raw
    vLLM's server gets rollgen serve's: they run on engines of their own)."""
    seed = 0 if args.same_prompts else zlib.crc32(f"{kind}/{level}/{round_}".encode())
    return prompts(requests_for(level, args.requests, args.waves), vocab, args.prompt_len, seed)


def rotated(names: list[str], round_: int) -> list[str]:
    """``names`` in round ``round_``'s order: each round starts one later (A B C, B C A, ...)."""
    shift = round_ % len(names) if names else 0
    return names[shift:] + names[:shift]


def requests_for(level: int, least: int, waves: int) -> int:
    """How many requests a load of ``level`` in flight runs: ``waves`` times ``level``, at least
    ``least``."""
    return max(least, waves * level)


async def drive(
    requests: list[list[int]], in_flight: int, one: Callable[[list[int]], Awaitable[Outcome]]
) -> dict[str, Any]:
    """Run ``one(prompt)`` for every prompt, ``in_flight`` at a time: each request's tokens,
    answer and first-token seconds, the load's start and end (``perf_counter``) and the CPU
    seconds this process spent."""
    gate = asyncio.Semaphore(in_flight)
    tokens: list[int] = []
    answers: list[float] = []
    firsts: list[float] = []

    async def timed(prompt: list[int]) -> None:
        async with gate:
            t = time.perf_counter()
            n, first = await one(prompt)
            answers.append(time.perf_counter() - t)
            firsts.append(first - t)
            tokens.append(n)

    cpu, start = time.process_time(), time.perf_counter()
    await asyncio.gather(*(timed(p) for p in requests))
    return {
        "start": start,
        "end": time.perf_counter(),
        "cpu_s": time.process_time() - cpu,
        "tokens": tokens,
        "answers": answers,
        "firsts": firsts,
    }


def summarize(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the ``drive`` results of a load's parts (run at the same time)."""
    tokens = [n for p in parts for n in p["tokens"]]
    answers = sorted(a for p in parts for a in p["answers"])
    firsts = sorted(f for p in parts for f in p["firsts"])
    wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    return {
        "requests": len(tokens),
        "wall_s": wall,
        "tokens": sum(tokens),
        "tokens_per_s": sum(tokens) / wall,
        "tokens_per_request": sum(tokens) / len(tokens),
        "fewest_tokens": min(tokens),
        "median_answer_s": statistics.median(answers),
        "p99_answer_s": answers[min(len(answers) - 1, int(0.99 * len(answers)))],
        "median_ttft_s": statistics.median(firsts),
        "p99_ttft_s": firsts[min(len(firsts) - 1, int(0.99 * len(firsts)))],
    }


def in_process(
    gen: Any, max_tokens: int, temperature: float, stream: bool = False
) -> Callable[[list[int]], Awaitable[Outcome]]:
    """A contestant: ``gen.submit`` of the batch the server makes of a request. Not streamed,
    its first token is its answer (the rollout yields whole samples); ``stream``: submitted with
    ``stream_tokens=True`` as the server submits a streamed request, its first token the first
    ``TokenDelta`` (the HTTP layer's cost alone is then serve / this)."""

    async def one(prompt: list[int]) -> Outcome:
        batch = {
            "input_ids": torch.tensor([prompt]),
            "input_lengths": torch.tensor([len(prompt)]),
            "max_new_tokens": torch.tensor([max_tokens]),
            "temperature": torch.tensor([float(temperature)]),
        }
        rollout = gen.submit(batch, stream_tokens=stream)
        if not stream:
            tokens = sum([len(r.token_ids) async for r in rollout])
            return tokens, time.perf_counter()
        first: float | None = None
        tokens = 0
        async for event in rollout.events():
            if isinstance(event, TokenDelta):
                first = first or time.perf_counter()
            else:
                tokens += len(event.token_ids)
        return tokens, first or time.perf_counter()

    return one


def completion_body(model: str, max_tokens: int, temperature: float, stream: bool) -> dict[str, Any]:
    """A ``/v1/completions`` request's fields besides its prompt."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def over_http(
    session: aiohttp.ClientSession, url: str, key: str, body: dict[str, Any]
) -> Callable[[list[int]], Awaitable[Outcome]]:
    """A contestant: one ``/v1/completions`` request per prompt. Streamed, its first token is
    the first chunk's arrival and its tokens the usage event's; else both are the answer's."""
    headers = {"Authorization": f"Bearer {key}"}

    async def one(prompt: list[int]) -> Outcome:
        request = {**body, "prompt": prompt}
        async with session.post(f"{url}/completions", json=request, headers=headers) as answer:
            if answer.status != 200:
                raise RuntimeError(f"{url}: HTTP {answer.status}: {await answer.text()}")
            if not body.get("stream"):
                data = await answer.json()
                return int(data["usage"]["completion_tokens"]), time.perf_counter()
            first: float | None = None
            chunks = []
            async for chunk in answer.content.iter_any():
                first = first or time.perf_counter()
                chunks.append(chunk)
        return streamed_tokens(b"".join(chunks), url), first or time.perf_counter()

    return one


def streamed_tokens(stream: bytes, url: str) -> int:
    """The generated tokens of a server-sent event stream, from its last event (usage)."""
    events = [e[len(b"data: ") :] for e in stream.split(b"\n\n") if e.startswith(b"data: ")]
    last: dict[str, Any] = next((json.loads(e) for e in reversed(events) if e.strip() != b"[DONE]"), {})
    if "error" in last or not last.get("usage"):
        raise RuntimeError(f"{url}: a stream without usage at its end: {stream[-500:]!r}")
    return int(last["usage"]["completion_tokens"])


async def http_load(
    url: str, key: str, body: dict[str, Any], requests: list[list[int]], in_flight: int, warmup: int
) -> dict[str, Any]:
    """``requests`` over HTTP, ``in_flight`` at a time on as many connections, after ``warmup``
    of them untimed; ``drive``'s result."""
    connector = aiohttp.TCPConnector(limit=in_flight)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        one = over_http(session, url, key, body)
        await drive(warmup_prompts(requests, warmup), in_flight, one)
        return await drive(requests, in_flight, one)


def warmup_prompts(requests: list[list[int]], n: int) -> list[list[int]]:
    """What a load runs untimed first: its first ``n`` prompts reversed (as long, and sharing no
    prefix with any of the load's, whose prefill the timed load then decodes as any other)."""
    return [p[::-1] for p in requests[:n]]


def _client(conn: multiprocessing.connection.Connection) -> None:
    """A load-generator process: runs each ``http_load`` job sent, answers its result (or
    ``("error", traceback)``), ends when the pipe closes or sends None. The parent stops it:
    SIGINT (a time limit's) is the parent's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        try:
            conn.send(asyncio.run(http_load(**job)))
        except Exception:  # noqa: BLE001 - reported to the parent, which raises it
            conn.send(("error", traceback.format_exc()))


class LoadClients:
    """``n`` load-generator processes (spawned once, kept for every load), each driving its share
    of a load: every n-th request and its share of the requests in flight. Their CPU is the
    ``client`` column; the server's process does none of their work."""

    def __init__(self, n: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.pipes: list[multiprocessing.connection.Connection] = []
        self.procs: list[Any] = []
        for _ in range(n):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_client, args=(theirs,), daemon=True, name="load-client")
            proc.start()
            self.pipes.append(mine)
            self.procs.append(proc)

    def __len__(self) -> int:
        return len(self.procs)

    def run(self, url: str, key: str, body: dict[str, Any], requests: list[list[int]], in_flight: int) -> Any:
        """The load's parts (``drive`` results), one per client that got requests."""
        n = min(len(self), in_flight, len(requests))
        for i, conn in enumerate(self.pipes[:n]):
            share = in_flight // n + (i < in_flight % n)
            job = {"url": url, "key": key, "body": body, "requests": requests[i::n], "in_flight": share}
            conn.send(job | {"warmup": min(WARMUP, share)})
        parts = [conn.recv() for conn in self.pipes[:n]]
        for part in parts:
            if isinstance(part, tuple):
                raise RuntimeError(f"a load client failed:\n{part[1]}")
        return parts

    def close(self) -> None:
        for conn in self.pipes:
            try:
                conn.send(None)
            except OSError:  # a client already gone
                pass
            conn.close()
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()


def busy_cpu_s() -> float:
    """CPU seconds every core of the machine spent busy (not idle, not waiting on I/O)."""
    t = psutil.cpu_times()
    return float(sum(t)) - t.idle - getattr(t, "iowait", 0.0)


def process_cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


#: Seconds between two looks at how many requests the engine runs (``mean_running``).
RUNNING_EVERY_S = 0.02


class RunningProbe:
    """Samples ``running()`` (how many requests the engine has: started, not yet ended) every
    ``RUNNING_EVERY_S`` from a thread while a load runs; ``mean`` of what it saw. Below the
    level in flight it says the engine waited for requests (the path between an answer's end
    and the next request's start), not that its steps were slow."""

    def __init__(self, running: Callable[[], int]) -> None:
        self.running = running
        self.seen: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="running-probe")

    def __enter__(self) -> RunningProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(RUNNING_EVERY_S):
            self.seen.append(self.running())

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.seen) if self.seen else None


class StartCalls:
    """Counts the calls that hand streamed samples to a Ray generation's engines (each engine
    actor's ``start_samples``, which the dispatcher makes for what queued since its last call),
    by wrapping the actor handles' method here, in the benchmark only; ``count`` so far."""

    def __init__(self, gen: Any) -> None:
        self.count = 0
        self._lock = threading.Lock()
        for worker in gen.engines.group.workers:
            worker.start_samples = _CountedMethod(worker.start_samples, self)

    @staticmethod
    def of(gen: Any) -> Callable[[], int] | None:
        """``gen``'s counter (installed once); None for a generation without Ray engines."""
        if getattr(gen, "engines", None) is None:
            return None
        method = gen.engines.group.workers[0].start_samples
        counter = method.counter if isinstance(method, _CountedMethod) else StartCalls(gen)
        return lambda: counter.count


class _CountedMethod:
    """An actor method whose ``.remote`` calls are counted, then made."""

    def __init__(self, method: Any, counter: StartCalls) -> None:
        self.method, self.counter = method, counter

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        with self.counter._lock:
            self.counter.count += 1
        return self.method.remote(*args, **kwargs)


def generation_running(gen: Any) -> Callable[[], int]:
    """The requests a rollgen generation's engines run (its driver's count)."""
    return lambda: sum(r.running for r in gen.replica_load())


def measured(
    name: str,
    level: int,
    run: Callable[[], list[dict[str, Any]]],
    server_pid: int,
    clients_apart: bool,
    front_pid: int | None = None,
    running: Callable[[], int] | None = None,
    calls: Callable[[], int] | None = None,
) -> dict[str, Any]:
    """One contestant's row at ``level`` in flight: ``run()`` → the load's parts; CPU per request
    of the load's processes (``clients_apart``: its parts' own; else none apart from the
    server's), of the server's process (the trainer's: its driver, and its HTTP side unless that
    runs apart), of the HTTP side's own process (``front_pid``) and of everything else; with
    ``running``, the mean number of requests the engine ran meanwhile (``RunningProbe``); with
    ``calls``, the calls that started samples on the engines, per request (``StartCalls``)."""
    front_cpu = (lambda: process_cpu_s(front_pid)) if front_pid is not None else (lambda: 0.0)
    busy, server, front = busy_cpu_s(), process_cpu_s(server_pid), front_cpu()
    probe = RunningProbe(running) if running is not None else None
    calls_before = calls() if calls is not None else 0
    with probe or contextlib.nullcontext():
        parts = run()
    busy, server = busy_cpu_s() - busy, process_cpu_s(server_pid) - server
    front = front_cpu() - front
    row = {"contestant": name, "in_flight": level, **summarize(parts)}
    client = sum(p["cpu_s"] for p in parts) if clients_apart else 0.0
    per_request = 1000 / row["requests"]
    row.update(
        client_cpu_ms=client * per_request if clients_apart else None,
        server_cpu_ms=server * per_request,
        front_cpu_ms=front * per_request if front_pid is not None else None,
        other_cpu_ms=max(0.0, busy - client - server - front) * per_request,
        mean_running=probe.mean if probe is not None else None,
        engine_calls=(calls() - calls_before) / row["requests"] if calls is not None else None,
    )
    return row


def record(
    rows: list[dict[str, Any]], name: str, level: int, measure: Callable[[], dict[str, Any]], round_: int = 0
) -> None:
    """Adds ``measure()``'s row (of round ``round_``) to ``rows`` and prints it; a load that
    failed (an HTTP error, a lost connection, rollgen's error) is logged and added as a row with
    its ``error``, so that the other contestants are still measured."""
    try:
        rows.append({**measure(), "round": round_})
    except (RuntimeError, aiohttp.ClientError, RollgenError) as exc:
        logger.error("%s at %d in flight failed: %s", name, level, exc)
        rows.append({"contestant": name, "in_flight": level, "round": round_, "error": str(exc)[-2000:]})
        return
    print_table(rows[-1:], COLUMNS)


def measured_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "error" not in r]


def http_contestant(
    clients: LoadClients, url: str, key: str, body: dict[str, Any], load: list[list[int]], level: int
) -> Callable[[], list[dict[str, Any]]]:
    """A load over HTTP: from the client processes, or (none) from this process."""
    if len(clients):
        return lambda: clients.run(url, key, body, load, level)
    return lambda: [asyncio.run(http_load(url, key, body, load, level, min(WARMUP, level)))]


def submit_contestant(
    gen: Any, max_tokens: int, temperature: float, load: list[list[int]], level: int, stream: bool = False
) -> Callable[[], list[dict[str, Any]]]:
    async def both() -> dict[str, Any]:
        one = in_process(gen, max_tokens, temperature, stream)
        await drive(warmup_prompts(load, min(WARMUP, level)), level, one)
        return await drive(load, level, one)

    return lambda: [asyncio.run(both())]


#: The in-process contestant submitting as the server does a streamed request (``--stream``).
STREAMED_SUBMIT = "in-process submit, streamed"
#: rollgen's server, whose loads' prompts (``load_prompts``) another server's are given.
SERVED = "rollgen serve"
#: The contestant of a server's answers not streamed, beside its streamed one (``--plain``).
NOT_STREAMED = ", not streamed"


def measure_rollgen(
    gen: Any,
    server: Any,
    clients: LoadClients,
    args: argparse.Namespace,
    vocab: int,
    rows: list[Any],
    plain: bool = False,
    label: str = "",
    submit: bool = True,
) -> list[dict[str, Any]]:
    """rollgen's contestants at each level of ``args.in_flight``: its server (named ``"rollgen
    serve" + label``; ``plain``: also with answers not streamed), then (``submit``) in-process
    ``submit``, each row added to ``rows`` and printed as it is measured."""
    body = completion_body(server.model_id, args.max_tokens, args.temperature, args.stream)
    whole = completion_body(server.model_id, args.max_tokens, args.temperature, False)
    name = "rollgen serve" + label
    for level in args.in_flight:
        for round_ in range(args.rounds):
            load = partial(load_prompts, args, vocab, level=level, round_=round_)
            contestants = {
                name: http_contestant(clients, server.url, server.api_key, body, load(name), level)
            }
            if submit:
                contestants["in-process submit"] = submit_contestant(
                    gen, args.max_tokens, args.temperature, load("in-process submit"), level
                )
                if args.stream:
                    contestants[STREAMED_SUBMIT] = submit_contestant(
                        gen, args.max_tokens, args.temperature, load(STREAMED_SUBMIT), level, stream=True
                    )
            if plain and args.stream:
                contestants[name + NOT_STREAMED] = http_contestant(
                    clients, server.url, server.api_key, whole, load(name + NOT_STREAMED), level
                )
            for who in rotated(list(contestants), round_):
                http = who.startswith("rollgen serve")
                apart, front = http and len(clients) > 0, server.front_pid if http else None
                measure = partial(
                    measured,
                    who,
                    level,
                    contestants[who],
                    psutil.Process().pid,
                    apart,
                    front,
                    generation_running(gen),
                    StartCalls.of(gen),
                )
                record(rows, who, level, measure, round_)
    return rows


#: Where each ``--front`` runs the HTTP side, in that order (the later ones labelled).
FRONTS = {"process": ["process"], "thread": ["thread"], "both": ["process", "thread"]}


def measure_fronts(
    gen: Any, clients: LoadClients, args: argparse.Namespace, vocab: int, rows: list[Any], plain: bool
) -> list[dict[str, Any]]:
    """``measure_rollgen`` with a server of each ``--front`` in turn (in-process ``submit``
    with the first; the others' contestants named ``rollgen serve (thread front)``)."""
    for i, front in enumerate(FRONTS[args.front]):
        with rollgen.serve(gen, limits=serve_limits(args), front=front) as server:
            label = f" ({front} front)" if i else ""
            measure_rollgen(gen, server, clients, args, vocab, rows, plain, label, submit=i == 0)
    return rows


def add_load_arguments(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """The load's flags (``defaults`` override the smoke-run ones)."""
    levels = defaults.get("in_flight", [8, 32])
    parser.add_argument("--in-flight", type=lambda s: [int(x) for x in s.split(",")], default=levels)
    parser.add_argument(
        "--requests", type=int, default=defaults.get("requests", 64), help="requests per level, at least"
    )
    parser.add_argument(
        "--waves", type=int, default=defaults.get("waves", 1), help="requests per level: this x in-flight"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="loads of each contestant per level, interleaved (each round starts one contestant later)",
    )
    parser.add_argument(
        "--same-prompts",
        action="store_true",
        help="every load the same prompts (default: each contestant, level and round its own)",
    )
    parser.add_argument("--max-tokens", type=int, default=defaults.get("max_tokens", 16))
    parser.add_argument("--temperature", type=float, default=defaults.get("temperature", 0.0))
    parser.add_argument("--prompt-len", type=int, default=defaults.get("prompt_len", PROMPT_LEN))
    parser.add_argument(
        "--stream", action=argparse.BooleanOptionalAction, default=defaults.get("stream", False)
    )
    parser.add_argument(
        "--clients", type=int, default=defaults.get("clients", 0), help="load processes (0: this one)"
    )
    parser.add_argument(
        "--front",
        choices=list(FRONTS),
        default="process",
        help="where rollgen serve's HTTP side runs (both: in a process, then in a thread, each loaded)",
    )
    parser.add_argument("--out", default="out/benchmarks")


def serve_limits(args: argparse.Namespace) -> Limits:
    """The server's limits for the load: every request in flight admitted, on a connection of
    its own (with room for the warm-up's)."""
    most = max(args.in_flight)
    return Limits(
        max_concurrent_requests=max(Limits().max_concurrent_requests, most),
        max_connections=max(Limits().max_connections, 2 * most),
    )


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="hf")
    parser.add_argument("--config", default=None, help="JSON merged into the tiny model's config")
    add_load_arguments(parser)
    args = parser.parse_args(argv)
    config = tiny_config(args.backend, max_new_tokens=args.max_tokens, **json.loads(args.config or "{}"))
    clients = LoadClients(args.clients)
    try:
        with rollgen.create_generation(config) as gen:
            rows = measure_fronts(gen, clients, args, gen.model_info.vocab_size, [], False)
    finally:
        clients.close()
    print_table(measured_rows(rows), COLUMNS)
    write_results("serve", rows, args.out)
    return rows


if __name__ == "__main__":
    main()
