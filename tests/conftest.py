import json
import subprocess
import sys

import pytest
from hypothesis import settings

from rollgen.testing.tiny_model import cache_root, tiny_model_dir

# Property tests must not depend on the machine's load or on luck: no deadline, and the same
# examples in every run.
settings.register_profile("rollgen", deadline=None, derandomize=True)
settings.load_profile("rollgen")


@pytest.fixture(scope="session")
def model_dir() -> str:
    return tiny_model_dir()


@pytest.fixture(scope="session")
def prepared() -> str:
    """What in-process runs of the suite (pytester) must find ready, done before pytester
    snapshots the process: the tiny models' cache (pytester points HOME elsewhere, where they
    would be built again: minutes), and the engines' imports (an in-process run unloads the
    modules it imported, which breaks transformers' lazy imports in the next run). Returns the
    cache folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rollgen_example.engine  # noqa: F401
    import rollgen_hf.generation  # noqa: F401

    AutoModelForCausalLM.from_pretrained(tiny_model_dir())
    AutoTokenizer.from_pretrained(tiny_model_dir())
    return str(cache_root())


@pytest.fixture(scope="session")
def pad_id(model_dir: str) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).pad_token_id


@pytest.fixture(scope="session")
def hf_config(model_dir: str, pad_id: int) -> dict:
    return {
        "backend": "hf",
        "model_name": model_dir,
        "max_new_tokens": 8,
        "pad_token_id": pad_id,
        "dtype": "float32",
    }


@pytest.fixture(scope="session")
def cli_backends() -> dict:
    """``rollgen backends --json`` from a fresh process, by backend name."""
    out = subprocess.run(
        [sys.executable, "-m", "rollgen.cli", "backends", "--json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {r["name"]: r for r in json.loads(out)}


def pytest_collection_modifyitems(config, items) -> None:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "gpu2" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))
