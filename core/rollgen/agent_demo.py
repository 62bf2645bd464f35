"""The agentic demo (``rollgen demo --agent``): RL of tool use through ``rollgen serve``.

The generation serves an OpenAI-compatible endpoint in the trainer's process (``rollgen.serve``).
Each step, agent code, written as agent code is (the official ``openai`` SDK, async, one session
per episode), asks the agent tiny model arithmetic questions with a ``calculator`` tool
(``rollgen.testing.tool_use``): it runs the tool calls the server parsed from the model's replies
and sends their results back, turn after turn, until the model answers. The trainer then reads
each episode's session (``GET /v1/sessions/{id}``: the engine's token ids, loss mask, logprobs
and weight versions), scores correct tool use, checks the engine's logprobs against its own for
the same tokens and weights, takes a policy-gradient step and refits the engine before the next
step's episodes. The reward rises from step to step.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

import rollgen
from rollgen.data import right_pad
from rollgen.testing.grpo import group_advantages, policy_loss, sequence_logprobs, update_and_refit
from rollgen.testing.reference import agreement, load_reference_model
from rollgen.testing.tool_use import TOOLS, Attempt, Question, calculator, call_arguments, questions


@dataclass(frozen=True)
class AgentDemoSettings:
    steps: int = 10
    #: Questions per step, each asked in ``group`` episodes (a GRPO group).
    questions: int = 2
    group: int = 8
    #: Tokens per reply, and replies per episode (each but the last may call the tool).
    max_tokens: int = 40
    max_turns: int = 3
    learning_rate: float = 1e-3
    seed: int = 0


@dataclass
class Episode:
    """One episode as the agent saw it: its session, what it made of each reply (``attempt``)
    and each reply's ``rollgen`` field (the engine's tokens, logprobs and versions)."""

    session_id: str
    attempt: Attempt
    turns: list[dict[str, Any]] = field(default_factory=list)


async def run_episode(
    client: openai.AsyncOpenAI,
    model: str,
    session_id: str,
    question: Question,
    settings: AgentDemoSettings,
    seed: int,
) -> Episode:
    """Ask ``question``; answer each calculator call the model makes with the tool's result, until
    it replies without one (its answer) or ``max_turns`` replies."""
    messages: list[Any] = [{"role": "user", "content": question.text}]
    episode = Episode(session_id, Attempt(question))
    for turn in range(settings.max_turns):
        done = await client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            max_tokens=settings.max_tokens,
            temperature=1.0,
            seed=seed + turn,
            extra_body={"session_id": session_id},
        )
        choice = done.choices[0]
        episode.turns.append((choice.model_extra or {})["rollgen"])
        reply = choice.message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            episode.attempt.answer = reply.content or ""
            return episode
        for call in reply.tool_calls:
            function = getattr(call, "function", None)
            expression = (
                call_arguments(function.arguments)
                if function is not None and function.name == "calculator"
                else None
            )
            result = calculator(expression) if expression is not None else "error: no such tool or expression"
            episode.attempt.calls.append(expression)
            episode.attempt.results.append(result)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return episode


async def run_episodes(
    url: str, api_key: str, model: str, asked: list[Question], settings: AgentDemoSettings, step: int
) -> list[Episode]:
    """Every question ``group`` times, all episodes at once, in order (a question's run together)."""
    async with openai.AsyncOpenAI(base_url=url, api_key=api_key) as client:
        jobs = [
            run_episode(
                client,
                model,
                f"step{step}-q{i}-e{k}",
                q,
                settings,
                seed=settings.seed + 1000 * step + 10 * (i * settings.group + k),
            )
            for i, q in enumerate(asked)
            for k in range(settings.group)
        ]
        return list(await asyncio.gather(*jobs))


def read_session(client: openai.OpenAI, session_id: str) -> dict[str, Any]:
    """``GET /v1/sessions/{id}`` through the SDK's client (its base URL and key)."""
    return dict(client.get(f"/sessions/{session_id}", cast_to=httpx.Response).json())


def train_on_sessions(
    gen: Any,
    policy: Any,
    optimizer: torch.optim.Optimizer,
    sessions: list[dict[str, Any]],
    rewards: torch.Tensor,
    group: int,
    pad_token_id: int,
) -> float:
    """A policy-gradient step on the sessions' tokens (the loss on their generated tokens, each
    episode weighted by its group-normalised reward), then the refit. Returns the largest
    |Δlogp| between the engine's logprobs and the trainer's before the step."""
    ids, ends = right_pad([s["token_ids"] for s in sessions], pad_token_id, torch.long)
    mask = right_pad([s["loss_mask"] for s in sessions], 0, torch.bool)[0][:, 1:]
    engine = right_pad([[lp or 0.0 for lp in s["logprobs"]] for s in sessions], 0.0, torch.float32)[0][:, 1:]
    logp = sequence_logprobs(policy, ids, ends)
    stats = agreement(engine, logp.detach(), mask)
    update_and_refit(gen, policy, optimizer, policy_loss(logp, mask, group_advantages(rewards, group)))
    return stats["max_abs"]


def agent_step(
    gen: Any,
    server: Any,
    policy: Any,
    optimizer: torch.optim.Optimizer,
    settings: AgentDemoSettings,
    step: int,
) -> tuple[dict[str, float], list[Episode], list[dict[str, Any]]]:
    """One step: the episodes, the sessions read back and freed, the update and refit. Returns the
    step's measures, the episodes and their sessions."""
    asked = questions(random.Random(settings.seed * 7919 + step), settings.questions)
    episodes = asyncio.run(run_episodes(server.url, server.api_key, server.model_id, asked, settings, step))
    with openai.OpenAI(base_url=server.url, api_key=server.api_key) as client:
        sessions = [read_session(client, e.session_id) for e in episodes]
        for e in episodes:
            client.delete(f"/sessions/{e.session_id}", cast_to=httpx.Response)
    rewards = torch.tensor([e.attempt.reward() for e in episodes])
    versions = sorted({span["version"] for s in sessions for span in s["versions"]})
    max_abs = train_on_sessions(
        gen, policy, optimizer, sessions, rewards, settings.group, gen.cfg["pad_token_id"]
    )
    n = len(episodes)
    return (
        {
            "reward": float(rewards.mean()),
            "called": sum(e.attempt.called for e in episodes) / n,
            "right_expression": sum(e.attempt.right_expression for e in episodes) / n,
            "used_result": sum(e.attempt.used_result for e in episodes) / n,
            "turns": sum(len(e.turns) for e in episodes) / n,
            "tokens": sum(len(s["token_ids"]) for s in sessions) / n,
            "version": float(versions[-1]) if versions else -1.0,
            "max_abs_dlogp": max_abs,
        },
        episodes,
        sessions,
    )


def run_agent_demo(
    backend: str, cfg: dict[str, Any], console: Console, settings: AgentDemoSettings | None = None
) -> list[dict[str, float]]:
    """RL of tool use on the agent tiny model (``cfg``'s model) through ``rollgen serve`` over
    ``backend``, shown as a table; each step's measures."""
    settings = settings or AgentDemoSettings()
    torch.manual_seed(settings.seed)
    policy = load_reference_model(cfg["model_name"]).train()
    optimizer = torch.optim.Adam(policy.parameters(), lr=settings.learning_rate)
    table = Table(
        title=f"rollgen demo --agent: RL of tool use through rollgen serve over backend {backend!r}",
        caption="per step: the episodes' weight version, mean reward, shares of episodes, replies and "
        "tokens per episode, the largest |Δlogp| between the engine's and the trainer's logprobs",
    )
    for column in (
        "step",
        "weights",
        "reward",
        "called tool",
        "right expr.",
        "used result",
        "replies",
        "tokens",
        "max |Δlogp|",
    ):
        table.add_column(column, justify="right")
    rows = []
    with rollgen.create_generation({**cfg, "dtype": "float32"}) as gen, rollgen.serve(gen) as server:
        for step in tqdm(range(settings.steps), desc="RL steps", unit="step"):
            row, _, _ = agent_step(gen, server, policy, optimizer, settings, step)
            rows.append(row)
            table.add_row(
                str(step),
                f"v{row['version']:.0f}",
                f"{row['reward']:.3f}",
                f"{row['called']:.0%}",
                f"{row['right_expression']:.0%}",
                f"{row['used_result']:.0%}",
                f"{row['turns']:.1f}",
                f"{row['tokens']:.0f}",
                f"{row['max_abs_dlogp']:.1e}",
            )
    console.print(table)
    episodes = settings.questions * settings.group
    console.print(
        f"reward (0.5 for calling the calculator, 0.25 more for the question's expression, 0.25 more "
        f"for then answering with the tool's result): "
        f"[bold]{rows[0]['reward']:.3f} → {rows[-1]['reward']:.3f}[/] over {settings.steps} steps of "
        f"{episodes} episodes; the sessions' logprobs matched the trainer's "
        f"to within {max(r['max_abs_dlogp'] for r in rows):.1e}"
    )
    return rows
