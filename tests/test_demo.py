"""The demo (``rollgen demo``, the README's main job) on the HF engine: the reward rises and the
engine's logprobs are the trainer's."""

from rich.console import Console

from rollgen.demo import DemoSettings, reward, run_demo
from rollgen.testing.config import tiny_config


def test_reward_counts_the_items_continued_correctly() -> None:
    assert reward("count: 3 4 5", " 6 7 9 10") == 2 / 6
    assert reward("abc: c d", " e f g h i j k") == 1.0
    assert reward("count: 40", "") == 0.0


def test_the_demo_learns_and_the_logprobs_agree() -> None:
    rows = run_demo("hf", tiny_config("hf"), Console(quiet=True), DemoSettings(steps=5))
    assert len(rows) == 5
    assert rows[-1]["reward"] > rows[0]["reward"] + 0.1, [r["reward"] for r in rows]
    assert max(r["max_abs_dlogp"] for r in rows) < 1e-4, rows
