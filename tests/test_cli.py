"""The ``rollgen`` command: its configs, its one-line errors, what it forwards to the suite."""

import os
import re
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from rollgen import cli
from rollgen.testing.config import tiny_config

NOT_FOUND = "no rollgen backend named 'no-such-backend'"


def rollgen(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``rollgen ARGS`` in a fresh process (``ROLLGEN_DEBUG`` only where ``env`` sets it)."""
    base = {k: v for k, v in os.environ.items() if k != "ROLLGEN_DEBUG"}
    return subprocess.run(
        [sys.executable, "-m", "rollgen.cli", *args],
        capture_output=True,
        text=True,
        env={**base, **env},
        timeout=300,
    )


def test_tiny_config(model_dir: str) -> None:
    cfg = tiny_config("hf", max_new_tokens=3, vllm_cfg={"in_process": True})
    assert cfg == {
        "backend": "hf",
        "model_name": model_dir,
        "max_new_tokens": 3,
        "pad_token_id": AutoTokenizer.from_pretrained(model_dir).pad_token_id,
        "seed": 0,
        "vllm_cfg": {"in_process": True},
    }


def test_cli_config_is_the_tiny_config_without_the_conformance_hook() -> None:
    """The example plugin's conformance hook adds ``example_cfg`` for the suite, not here."""
    got = cli._config("example", None, 5, '{"seed": 3, "example_cfg": {"x": 1}}')
    assert got == tiny_config("example", max_new_tokens=5, seed=3, example_cfg={"x": 1})
    assert cli._config("example", None, 5, None) == tiny_config("example", max_new_tokens=5)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "hi", "--backend", "no-such-backend"], NOT_FOUND),
        (["demo", "--backend", "no-such-backend"], NOT_FOUND),
        (["generate", "hi", "--config", "{x"], "--config is not valid JSON"),
        (["generate", "hi", "--config", "[1]"], "--config must be a JSON object, got '[1]'"),
        (["serve", "/no/such/config.json"], "neither JSON text nor a readable file"),
        (["serve", '{"backend": "no-such-backend"'], "is not valid JSON"),
        (["serve", '{"backend": "no-such-backend"}'], NOT_FOUND),
    ],
)
def test_a_rollgen_error_is_one_line(args: list[str], message: str) -> None:
    result = rollgen(*args)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1, f"exit {result.returncode}, stderr: {result.stderr}"
    assert len(lines) == 1 and message in lines[0], f"expected one line naming {message!r}: {lines}"


@pytest.mark.parametrize(("flag", "env"), [(["--debug"], {}), ([], {"ROLLGEN_DEBUG": "1"})])
def test_debug_shows_the_traceback(flag: list[str], env: dict[str, str]) -> None:
    result = rollgen(*flag, "generate", "hi", "--backend", "no-such-backend", **env)
    assert result.returncode != 0, f"exit {result.returncode}"
    assert "Traceback" in result.stderr and "BackendNotFound" in result.stderr, result.stderr


def test_conformance_forwards_allow_unavailable() -> None:
    allowed = rollgen("conformance", "no-such-backend", "--allow-unavailable", "-q")
    assert allowed.returncode == 0, f"exit {allowed.returncode}: {allowed.stdout[-2000:]}"
    summary = allowed.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ skipped in [\d.]+s", summary), f"every test skipped, nothing else: {summary!r}"
    refused = rollgen("conformance", "no-such-backend", "-q")
    assert refused.returncode == pytest.ExitCode.USAGE_ERROR, f"exit {refused.returncode}"
    assert f"ERROR: rollgen conformance: {NOT_FOUND}" in refused.stderr, refused.stderr


def test_tiny_model_prints_the_folder(model_dir: str) -> None:
    from rollgen.testing import tiny_model_dir

    plain, agent = rollgen("tiny-model"), rollgen("tiny-model", "--agent")
    assert (plain.returncode, plain.stdout.strip()) == (0, model_dir), plain.stderr
    assert (agent.returncode, agent.stdout.strip()) == (0, tiny_model_dir(agent=True)), agent.stderr
