"""The backend guide's code runs as written: docs/writing-a-backend.md's plugin module registers
a valid backend, its engine class generates what the HF backend generates and takes a refit, and
its conformance hooks answer (as datasette tests its documentation)."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import rollgen
from rollgen.config import validate_config
from rollgen.errors import ConfigError
from rollgen.testing.prompts import PROMPTS, encode
from rollgen.testing.reference import load_reference_model

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "writing-a-backend.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)


def run_block(code: str, name: str) -> dict[str, Any]:
    """Run ``code`` as the module ``name`` (registered, so that pydantic resolves its types)."""
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(code, str(GUIDE), "exec"), module.__dict__)  # noqa: S102 - the guide's own code
    return module.__dict__


def test_the_guide_has_its_code_blocks() -> None:
    assert len(python_blocks()) == 3, "plugin module, engine class, conformance hooks"


def test_the_guides_plugin_registers_a_valid_backend() -> None:
    plugin = run_block(python_blocks()[0], "guide_plugin")
    registered: list[rollgen.Backend] = []
    plugin["rollgen_register_backends"](registered.append)
    (backend,) = registered
    assert backend.name == "mine" and rollgen.Capability.REFIT_TENSORS in backend.capabilities
    base = {"backend": "mine", "model_name": "m", "max_new_tokens": 1, "pad_token_id": 0}
    cfg = validate_config(base, backend.config_type)
    assert cfg["my_cfg"] == {"memory_fraction": 0.5}, "no sub-dict given: its defaults are in the config"
    with pytest.raises(ConfigError, match="my_cfg.memory_fracton: unknown key"):
        validate_config({**base, "my_cfg": {"memory_fracton": 0.2}}, backend.config_type)


def test_the_guides_engine_generates_what_the_hf_backend_does(hf_config: dict, model_dir: str) -> None:
    from transformers import AutoTokenizer

    plugin, engine = (
        run_block(python_blocks()[0], "guide_plugin"),
        run_block(python_blocks()[1], "guide_engine"),
    )
    registered: list[rollgen.Backend] = []
    plugin["rollgen_register_backends"](registered.append)
    cfg = validate_config({**hf_config, "backend": "mine", "seed": 5}, registered[0].config_type)
    batch = encode(AutoTokenizer.from_pretrained(model_dir), PROMPTS)
    with (
        engine["MyGeneration"](cfg, backend=registered[0]) as mine,
        rollgen.create_generation(hf_config) as hf,
    ):
        ours, theirs = mine.generate(batch, greedy=True), hf.generate(batch, greedy=True)
        assert torch.equal(ours["output_ids"], theirs["output_ids"])
        assert torch.allclose(ours["logprobs"], theirs["logprobs"], atol=1e-4)
        assert ours["stop_reasons"] == theirs["stop_reasons"]
        seeded = {**batch, "seed": torch.arange(11, 16)}  # each sample's seed alone drives it
        alone = mine.generate({k: v[:1] for k, v in seeded.items()})
        together = mine.generate(seeded)
        n = int(alone["unpadded_sequence_lengths"][0])
        assert torch.equal(alone["output_ids"][0, :n], together["output_ids"][0, :n])
        mine.refit(load_reference_model(model_dir))


def test_the_guides_conformance_hooks_answer() -> None:
    hooks = run_block(python_blocks()[2], "guide_hooks")
    assert hooks["rollgen_conformance_config"](backend="mine", base={}) == {
        "my_cfg": {"memory_fraction": 0.2}
    }
    assert "test_reference_agreement[float32]" in hooks["rollgen_conformance_known_failures"](backend="mine")
