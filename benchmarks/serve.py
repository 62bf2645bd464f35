"""The OpenAI endpoint's cost: the same requests through ``rollgen.serve`` (driven by an aiohttp
load generator, one connection per request in flight) and through in-process ``submit`` (one
single-sample rollout per request), at each number of requests in flight; optionally also
against another OpenAI-compatible server of the same model (``--compare-url``: raw ``vllm
serve``). Per contestant: wall time, generated tokens per second, the median and p99 time to a
request's answer, and the CPU seconds this process spent per request (the server's work on top
of the engine's is the difference to in-process).

    python -m benchmarks.serve [--backend hf] [--config JSON] [--requests 64] [--in-flight 8,32]
        [--max-tokens 16] [--compare-url http://127.0.0.1:8000/v1 --compare-model NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import torch

import rollgen
from benchmarks.common import print_table, write_results
from rollgen.testing.config import tiny_config

PROMPT_LEN = 8


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    ids = torch.randint(10, min(vocab, 400), (n, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))
    return ids.tolist()


async def drive(
    requests: list[list[int]], in_flight: int, one: Callable[[list[int]], Awaitable[int]]
) -> dict[str, Any]:
    """Run ``one(prompt)`` (→ generated tokens) for every prompt, ``in_flight`` at a time."""
    gate = asyncio.Semaphore(in_flight)
    latencies: list[float] = []

    async def timed(prompt: list[int]) -> int:
        async with gate:
            t = time.perf_counter()
            tokens = await one(prompt)
            latencies.append(time.perf_counter() - t)
            return tokens

    cpu, wall = time.process_time(), time.perf_counter()
    tokens = sum(await asyncio.gather(*(timed(p) for p in requests)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    latencies.sort()
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "median_answer_s": statistics.median(latencies),
        "p99_answer_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "cpu_ms_per_request": 1000 * cpu / len(requests),
    }


def in_process(gen: Any, max_tokens: int) -> Callable[[list[int]], Awaitable[int]]:
    async def one(prompt: list[int]) -> int:
        batch = {
            "input_ids": torch.tensor([prompt]),
            "input_lengths": torch.tensor([len(prompt)]),
            "max_new_tokens": torch.tensor([max_tokens]),
        }
        rollout = gen.submit(batch, greedy=True)
        return sum([len(r.token_ids) async for r in rollout])

    return one


def over_http(
    session: aiohttp.ClientSession, url: str, key: str, model: str, max_tokens: int
) -> Callable[[list[int]], Awaitable[int]]:
    headers = {"Authorization": f"Bearer {key}"}

    async def one(prompt: list[int]) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        async with session.post(f"{url}/completions", json=body, headers=headers) as answer:
            if answer.status != 200:
                raise RuntimeError(f"{url}: {answer.status} {await answer.text()}")
            data = await answer.json()
        return int(data["usage"]["completion_tokens"])

    return one


async def measure(gen: Any, server: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    load = prompts(args.requests, gen.model_info.vocab_size)
    rows = []
    for level in args.in_flight:
        connector = aiohttp.TCPConnector(limit=level)
        async with aiohttp.ClientSession(connector=connector) as session:
            contestants = {
                "in-process submit": in_process(gen, args.max_tokens),
                "rollgen serve": over_http(
                    session, server.url, server.api_key, server.model_id, args.max_tokens
                ),
            }
            if args.compare_url:
                contestants["compared server"] = over_http(
                    session,
                    args.compare_url.rstrip("/"),
                    args.compare_key,
                    args.compare_model,
                    args.max_tokens,
                )
            for name, one in contestants.items():
                await drive(load[: min(len(load), level)], level, one)  # warm-up
                rows.append({"contestant": name, "in_flight": level, **await drive(load, level, one)})
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="hf")
    parser.add_argument("--config", default=None, help="JSON merged into the tiny model's config")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--in-flight", type=lambda s: [int(x) for x in s.split(",")], default=[8, 32])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--compare-url", default=None)
    parser.add_argument("--compare-key", default="none")
    parser.add_argument("--compare-model", default=None)
    parser.add_argument("--out", default="out/benchmarks")
    args = parser.parse_args(argv)
    config = tiny_config(args.backend, max_new_tokens=args.max_tokens, **json.loads(args.config or "{}"))
    with rollgen.create_generation(config) as gen, rollgen.serve(gen) as server:
        rows = asyncio.run(measure(gen, server, args))
    print_table(
        rows,
        ["contestant", "in_flight", "tokens_per_s", "median_answer_s", "p99_answer_s", "cpu_ms_per_request"],
    )
    write_results("serve", rows, args.out)
    return rows


if __name__ == "__main__":
    main()
