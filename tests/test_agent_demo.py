"""The agentic demo (``rollgen demo --agent``) and what it stands on: the agent tiny model (its
context, its chat template with tools, read back by the server's tool parser), the calculator
task's reward, and two steps of the demo's loop through ``rollgen serve`` and the openai SDK —
the sessions hold exactly the tokens and logprobs the SDK got, and the refit between the steps
shows in their versions."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

import rollgen
from rollgen.agent_demo import AgentDemoSettings, agent_step
from rollgen.errors import ConfigError
from rollgen.serving.tools import HermesToolParser
from rollgen.testing import load_reference_model
from rollgen.testing.config import tiny_config
from rollgen.testing.tiny_model import TinyModelRecipe, tiny_model_dir
from rollgen.testing.tool_use import TOOLS, Attempt, Question, calculator

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 + 7"}}</tool_call>'


@pytest.fixture(scope="module")
def agent_dir() -> str:
    return tiny_model_dir(agent=True)


def test_the_agent_model_is_a_recipe_of_its_own(agent_dir: str, model_dir: str) -> None:
    assert agent_dir != model_dir
    assert AutoConfig.from_pretrained(agent_dir).max_position_embeddings >= 2048
    with pytest.raises(ConfigError, match="not both"):
        tiny_model_dir(TinyModelRecipe(), agent=True)


@pytest.mark.parametrize(
    "arguments", ['{"expression": "12 + 7"}', {"expression": "12 + 7"}], ids=["openai-json-text", "dict"]
)
def test_the_template_writes_a_tool_call_once_and_the_parser_reads_it(
    agent_dir: str, arguments: object
) -> None:
    """An assistant's tool call with OpenAI's arguments (JSON text) or a dict renders as one
    ``<tool_call>`` of JSON (not JSON in a JSON string), which the ``hermes`` parser reads back."""
    tokenizer = AutoTokenizer.from_pretrained(agent_dir)
    call = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "What is 12 + 7?"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "19"},
        {"role": "assistant", "content": "19"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert f"<|im_start|>assistant\n{CALL}<|endoftext|>\n<|im_start|>tool\n19<|endoftext|>\n" in text
    assert text.startswith("<|im_start|>system\n<tools>" + json.dumps(TOOLS[0]) + "</tools>")
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    left, calls = HermesToolParser().parse(CALL)
    assert left == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("calculator", {"expression": "12 + 7"})
    ]


def test_the_calculator_and_the_reward() -> None:
    assert calculator("12 + 7") == "19" and calculator(" 3 * 40 ") == "120" and calculator("5 - 9") == "-4"
    assert calculator("__import__('os').getcwd()").startswith("error")
    q = Question(12, "+", 7)
    assert Attempt(q, ["12 + 7"], ["19"], "12 + 7 = 19").reward() == 1.0
    assert Attempt(q, ["12+7"], ["19"], "20").reward() == 0.75  # the right call, not its result
    assert Attempt(q, ["7 + 12"], ["19"], "19").reward() == 0.75  # not the question's expression
    assert Attempt(q, ["x"], ["error: ..."], "19").reward() == 0.0  # not an expression
    assert Attempt(q, [], [], "19").reward() == 0.0  # right, but without the tool
    assert Attempt(q, ["12 + 7"] * 2, ["19"] * 2, "19").reward() == 0.0  # one call is what it takes


def test_two_steps_of_the_agent_loop(agent_dir: str) -> None:
    """Episodes through the openai SDK; each session holds the engine's tokens and logprobs as
    the SDK got them, generated tokens masked in; the trainer's refit between the steps moves
    every session of the second step to the next weight version; the server parsed tool calls."""
    settings = AgentDemoSettings(steps=2, questions=2, group=4)
    cfg = tiny_config("hf", agent_dir, max_new_tokens=settings.max_tokens, dtype="float32")
    policy = load_reference_model(agent_dir).train()
    optimizer = torch.optim.Adam(policy.parameters(), lr=settings.learning_rate)
    versions = []
    calls = 0
    with rollgen.create_generation(cfg) as gen, rollgen.serve(gen) as server:
        for step in range(settings.steps):
            before = gen.weight_version
            row, episodes, sessions = agent_step(gen, server, policy, optimizer, settings, step)
            assert gen.weight_version == before + 1  # refitted after the step
            assert len(episodes) == len(sessions) == settings.questions * settings.group
            for episode, session in zip(episodes, sessions):
                last = episode.turns[-1]
                assert session["token_ids"] == last["prompt_token_ids"] + last["token_ids"]
                generated = [i for i, m in enumerate(session["loss_mask"]) if m]
                assert [session["token_ids"][i] for i in generated] == [
                    t for turn in episode.turns for t in turn["token_ids"]
                ]
                assert [session["logprobs"][i] for i in generated] == [
                    lp for turn in episode.turns for lp in turn["logprobs"]
                ]
                assert all(
                    session["logprobs"][i] is None for i, m in enumerate(session["loss_mask"]) if not m
                )
                assert {s["version"] for s in session["versions"]} == {before}
                calls += len(episode.attempt.calls)
            versions.append(before)
            assert row["max_abs_dlogp"] < 1e-4, row
    assert versions[1] == versions[0] + 1
    assert calls > 0, "no episode called the tool: the agent model's recipe or the seeds changed"
