"""An agent loop against ``rollgen.serve``, written as agent code is: the official openai client
(async), a tool, several turns, one session per episode, episodes running at once. The trainer,
in the same process, takes each episode as it finishes, makes a training step (a stand-in: its
weights shrink a little) and refits in ``keep`` mode while the other episodes run on; afterwards
it reads each session back (``GET /v1/sessions/{id}``) and checks that the tokens it would train
on are exactly the engine's: teacher-forced logprobs under the weights of each token's version
agree with the logprobs the engine returned.

    python examples/agent_loop.py [--backend hf] [--episodes 3] [--turns 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
from typing import Any

import httpx
import openai
import torch

import rollgen
from rollgen.testing import load_reference_model, versioned_logprob_error
from rollgen.testing.config import tiny_config
from rollgen.testing.tiny_model import tiny_model_dir

#: A tool, kept short: the tiny model's context is 256 tokens, and its tokenizer spends about one
#: on each character of JSON.
TOOLS: Any = [{"type": "function", "function": {"name": "next_numbers"}}]


def next_numbers(n: int) -> str:
    return " ".join(str(n + i) for i in range(1, 4))


async def episode(client: openai.AsyncOpenAI, model: str, session: str, turns: int, seed: int) -> None:
    """One conversation: the model's reply; its tool calls answered by the tool; else the
    environment's next observation as a user message (the tiny model calls no tools itself)."""
    messages: list[Any] = [{"role": "user", "content": "count: 3 4 5"}]
    for turn in range(turns):
        done = await client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            max_tokens=8,
            temperature=1.0,
            seed=seed + turn,
            extra_body={"session_id": session},
        )
        reply = done.choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls or []:
            args = json.loads(call.function.arguments or "{}")  # type: ignore[union-attr]
            answer = next_numbers(int(args.get("n", 0)))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
        if not reply.tool_calls:
            messages.append({"role": "user", "content": f"count: {10 * (turn + 1)} {10 * (turn + 1) + 1}"})


def main(backend: str, episodes: int, turns: int) -> None:
    model_dir = tiny_model_dir()
    trainer = load_reference_model(model_dir)
    weights: dict[int, Any] = {}

    def snapshot(version: int) -> None:
        weights[version] = load_reference_model(model_dir)
        weights[version].load_state_dict(trainer.state_dict())

    with (
        rollgen.create_generation(tiny_config(backend, dtype="float32")) as gen,
        rollgen.serve(gen) as server,
    ):
        finished: queue.Queue[int] = queue.Queue()

        async def agents() -> None:
            client = openai.AsyncOpenAI(base_url=server.url, api_key=server.api_key)

            async def run(e: int) -> None:
                await episode(client, server.model_id, f"episode-{e}", turns, seed=100 * e)
                finished.put(e)

            await asyncio.gather(*(run(e) for e in range(episodes)))

        snapshot(gen.weight_version)
        acting = threading.Thread(target=asyncio.run, args=(agents(),))
        acting.start()
        for _ in range(episodes):  # the trainer: a step and a refit per finished episode
            finished.get()
            with torch.no_grad():  # a stand-in training step: the next weights differ
                for p in trainer.parameters():
                    p.mul_(0.98)
            snapshot(gen.weight_version + 1)
            gen.refit(trainer, mode="keep")  # the episodes still running continue on the new weights
        acting.join()
        auth = {"Authorization": f"Bearer {server.api_key}"}
        for e in range(episodes):
            session = httpx.delete(f"{server.url}/sessions/episode-{e}", headers=auth).json()
            generated = sum(session["loss_mask"])
            versions = sorted({s["version"] for s in session["versions"]})
            error = versioned_logprob_error(
                session["token_ids"], session["logprobs"], session["versions"], weights
            )
            print(
                f"episode {e}: {len(session['token_ids'])} tokens, {generated} generated, versions "
                f"{versions}, max |logp - teacher-forced| {error:.2e}"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="hf")
    parser.add_argument("--episodes", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    args = parser.parse_args()
    main(args.backend, args.episodes, args.turns)
