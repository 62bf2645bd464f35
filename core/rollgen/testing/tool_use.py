"""The tool-use task of the agent tiny model and the agent demo: arithmetic questions that a
``calculator`` tool answers. The right way to answer is a call to the tool with the question's
expression, then the tool's result as the answer; the agent tiny model is trained on
conversations where it does that only some of the time (else it guesses a number), so that
reinforcement learning has something to raise."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: The tool, as an OpenAI ``tools`` entry (what the agent sends and the chat template shows).
CALCULATOR: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "integer arithmetic",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
#: ``tools`` as a request sends them (typed Any: the SDK's own types are TypedDicts of its own).
TOOLS: Any = [CALCULATOR]
_EXPRESSION = re.compile(r"\s*(\d{1,4})\s*([-+*])\s*(\d{1,4})\s*")
_OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class Question:
    """``a op b``, asked as ``What is a op b?``."""

    a: int
    op: str
    b: int

    @property
    def expression(self) -> str:
        return f"{self.a} {self.op} {self.b}"

    @property
    def text(self) -> str:
        return f"What is {self.expression}?"

    @property
    def value(self) -> int:
        return int(_OPERATIONS[self.op](self.a, self.b))


def questions(rng: random.Random, n: int) -> list[Question]:
    """``n`` questions with operands in [0, 99]."""
    return [Question(rng.randrange(100), rng.choice("+-*"), rng.randrange(100)) for _ in range(n)]


def calculator(expression: str) -> str:
    """The tool: the value of ``a op b`` (integers of up to 4 digits; +, - or *), or an error
    message for anything else (the model reads it as the tool's answer). Never evaluates code."""
    match = _EXPRESSION.fullmatch(expression)
    if match is None:
        return "error: expected an expression a op b of integers and one of + - *"
    a, op, b = match.groups()
    return str(_OPERATIONS[op](int(a), int(b)))


def call_arguments(arguments: str) -> str | None:
    """The ``expression`` of a tool call's arguments (JSON text), or None where there is none."""
    try:
        parsed = json.loads(arguments or "{}")
    except ValueError:
        return None
    expression = parsed.get("expression") if isinstance(parsed, dict) else None
    return expression if isinstance(expression, str) else None


@dataclass
class Attempt:
    """What the agent saw for one question: the expressions of the calculator calls the model
    made, in order (None for a call of another tool or without an expression), what the tool
    answered each, and the model's final answer (None if it never gave one)."""

    question: Question
    calls: list[str | None] = field(default_factory=list)
    results: list[str] = field(default_factory=list)
    answer: str | None = None

    @property
    def called(self) -> bool:
        """The first reply called the calculator, once, with an expression it evaluates."""
        return (
            len(self.calls) == 1
            and self.calls[0] is not None
            and _EXPRESSION.fullmatch(self.calls[0]) is not None
        )

    @property
    def right_expression(self) -> bool:
        """That call's expression is the question's."""
        return self.called and _same(str(self.calls[0]), self.question)

    @property
    def used_result(self) -> bool:
        """After that call, the answer ends with ``= result`` (or is the result) of the tool."""
        return (
            self.called and self.answer is not None and self.answer.split("=")[-1].strip() == self.results[0]
        )

    def reward(self) -> float:
        """Correct tool use: 0.5 for one well-formed calculator call as the first reply, 0.25 more
        if its expression is the question's, 0.25 more for then answering with the tool's result.
        An answer without the tool earns nothing, right or not."""
        return 0.5 * self.called + 0.25 * self.right_expression + 0.25 * self.used_result


def _same(expression: str, question: Question) -> bool:
    match = _EXPRESSION.fullmatch(expression)
    return match is not None and (int(match[1]), match[2], int(match[3])) == (
        question.a,
        question.op,
        question.b,
    )


def conversation(rng: random.Random, asked: Sequence[Question], tool_share: float) -> list[dict[str, Any]]:
    """A conversation of the training corpus: each question answered ``a op b = value`` through
    the calculator (with probability ``tool_share``; its arguments a JSON object, as a template
    gets them from a trainer's data) or with a guessed value."""
    messages: list[dict[str, Any]] = []
    for q in asked:
        messages.append({"role": "user", "content": q.text})
        if rng.random() < tool_share:
            call = {
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": q.expression}},
            }
            messages.append({"role": "assistant", "tool_calls": [call]})
            messages.append({"role": "tool", "content": str(q.value)})
            messages.append({"role": "assistant", "content": answer(q, q.value)})
        else:
            messages.append({"role": "assistant", "content": answer(q, rng.randrange(-99, 10000))})
    return messages


def answer(question: Question, value: int) -> str:
    """An answer as the corpus writes it: ``a op b = value``."""
    return f"{question.expression} = {value}"
