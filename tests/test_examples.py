"""The examples that run on CPU, run as a user runs them (docs/contract.md shows them)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("example", ["refit_one_process.py", "refit_other_process.py"])
def test_a_refit_example_runs_and_the_engine_follows_the_trainer(example: str) -> None:
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / example), "--backend", "hf"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    logprobs = [json.loads(line[line.index("[") :]) for line in run.stdout.splitlines() if "logprobs" in line]
    assert len(logprobs) == 2 and logprobs[0] != logprobs[1], run.stdout  # the new weights are served


def test_the_async_example_refits_while_samples_run() -> None:
    run = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "async_rollouts.py"),
            "--backend",
            "hf",
            "--samples",
            "12",
            "--step",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "refit to weight version 2 after 8 samples" in run.stdout, run.stdout
    assert "samples 12," in run.stdout, run.stdout
    shown = [line.split(":")[0] for line in run.stdout.splitlines() if " sample " in line]
    assert len(shown) == 4 and len(set(shown)) == 4, f"each result names its rollout: {shown}"
    assert all(name.startswith("batch ") for name in shown), shown


def test_the_agent_loop_trains_on_the_engines_own_tokens() -> None:
    """examples/agent_loop.py: episodes at once over the openai client, a keep-mode refit after
    each; every session's tokens score, under the weights of their versions, as the engine said
    (which versions an episode spans depends on the machine's speed)."""
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "agent_loop.py"), "--episodes", "3", "--turns", "3"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    episodes = [line for line in run.stdout.splitlines() if line.startswith("episode ")]
    assert len(episodes) == 3, run.stdout
    for line in episodes:
        versions = json.loads(line[line.index("versions ") + 9 : line.index("]") + 1])
        assert versions and set(versions) <= {0, 1, 2}, line
        assert float(line.rsplit(" ", 1)[1]) < 1e-4, line
