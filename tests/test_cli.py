"""The ``rollgen`` command's configs."""

from transformers import AutoTokenizer

from rollgen import cli
from rollgen.testing.config import tiny_config


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
