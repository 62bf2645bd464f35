"""create_generation: typed, complete errors before any engine work; the engine stays usable."""

import pytest
import torch

import rollgen
from rollgen import BackendNotFound, ConfigError, InputError


def test_unknown_backend_names_what_is_installed(hf_config: dict) -> None:
    with pytest.raises(BackendNotFound) as info:
        rollgen.create_generation({**hf_config, "backend": "nope"})
    assert "'nope'" in str(info.value) and "hf" in str(info.value) and "pip install" in str(info.value)
    with pytest.raises(BackendNotFound, match="Did you mean 'vllm'"):
        rollgen.create_generation({**hf_config, "backend": "vlm"})


def test_missing_backend_key(hf_config: dict) -> None:
    cfg = dict(hf_config)
    del cfg["backend"]
    with pytest.raises(ConfigError, match="'backend'"):
        rollgen.create_generation(cfg)


def test_every_problem_is_listed_at_once(hf_config: dict) -> None:
    cfg = {**hf_config, "temperature": "hot", "top_p": 1.5, "max_new_tokens": 0, "tempreature": 1.0}
    del cfg["pad_token_id"]
    with pytest.raises(ConfigError) as info:
        rollgen.create_generation(cfg)
    text = str(info.value)
    for key in ("temperature", "top_p", "max_new_tokens", "pad_token_id", "tempreature"):
        assert key in text
    assert len(info.value.problems) == 5


def test_engine_sub_dict_is_validated(hf_config: dict) -> None:
    with pytest.raises(ConfigError, match="hf_cfg.devcie"):
        rollgen.create_generation({**hf_config, "hf_cfg": {"devcie": "cpu"}})


def test_model_dir_must_exist(hf_config: dict, tmp_path) -> None:
    with pytest.raises(ConfigError, match="config.json"):
        rollgen.create_generation({**hf_config, "model_name": str(tmp_path)})


def test_left_padding_and_overlong_prompt_then_engine_works(hf_config: dict, pad_id: int) -> None:
    with rollgen.create_generation(hf_config) as gen:
        ids = torch.tensor([[5, 6, 7, pad_id], [pad_id, pad_id, 8, 9]])
        with pytest.raises(InputError, match="left-padded") as info:
            gen.generate({"input_ids": ids, "input_lengths": torch.tensor([3, 2])})
        assert info.value.samples == [1]
        long = torch.full((2, 300), 7)
        with pytest.raises(InputError, match="context") as info:
            gen.generate({"input_ids": long, "input_lengths": torch.tensor([10, 300])})
        assert info.value.samples == [1]
        good = gen.generate({"input_ids": ids[:1], "input_lengths": torch.tensor([3])}, greedy=True)
        assert good["generation_lengths"][0] >= 1


def test_processed_logprobs_follow_temperature(hf_config: dict, pad_id: int) -> None:
    """logprobs_mode='processed': logprobs of the tempered distribution (raw is the default)."""
    from rollgen.output import generated_mask
    from rollgen.testing import load_reference_model, teacher_forced_logprobs
    from rollgen.testing.reference import agreement

    ids = torch.tensor([[5, 6, 7]])
    lengths = torch.tensor([3])
    ref = load_reference_model(hf_config["model_name"])
    for mode, temp in (("processed", 0.7), ("raw", 1.0)):
        with rollgen.create_generation(
            {**hf_config, "logprobs_mode": mode, "temperature": 0.7, "seed": 3}
        ) as gen:
            out = gen.generate({"input_ids": ids, "input_lengths": lengths})
        expected = teacher_forced_logprobs(
            ref, out["output_ids"], lengths, out["unpadded_sequence_lengths"], temperature=temp
        )
        assert agreement(out["logprobs"], expected, generated_mask(out, lengths))["max_abs"] < 1e-4


def test_unseeded_engines_draw_different_samples(hf_config: dict) -> None:
    batch = {"input_ids": torch.tensor([[5, 6, 7]] * 8), "input_lengths": torch.tensor([3] * 8)}
    cfg = {**hf_config, "temperature": 1.5, "seed": None}
    with rollgen.create_generation(cfg) as a, rollgen.create_generation(cfg) as b:
        assert not torch.equal(a.generate(batch)["output_ids"], b.generate(batch)["output_ids"])


def test_model_eos_ids_come_from_the_generation_config_else_the_config(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from rollgen.model_info import ModelInfo

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 8, "eos_token_id": 2}))
    assert ModelInfo.from_dir(str(tmp_path)).eos_token_ids == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 2]}))
    assert ModelInfo.from_dir(str(tmp_path)).eos_token_ids == (5, 2)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    assert ModelInfo.from_dir(str(tmp_path)).eos_token_ids == ()


def test_eos_ids_join_the_stop_ids_of_every_sample() -> None:
    from rollgen.sampling import resolve_sampling

    cfg = {"temperature": 1.0, "top_p": 1.0, "top_k": None, "max_new_tokens": 4, "stop_token_ids": [7, 5]}
    data = {"input_ids": torch.zeros((2, 3), dtype=torch.long), "input_lengths": torch.tensor([3, 2])}
    params = resolve_sampling(cfg, data, greedy=False, max_model_len=16, eos_token_ids=(5, 2))
    assert [p.stop_token_ids for p in params] == [(7, 5, 2), (7, 5, 2)]


def _model_copy(model_dir: str, dest) -> str:  # type: ignore[no-untyped-def]
    """The model folder as links in ``dest``, so a test can break one file of it."""
    from pathlib import Path

    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        (out / f.name).symlink_to(f.resolve())
    return str(out)


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        ("config", "config.json: not readable JSON"),
        ("no_weights", "holds no weights"),
        ("bad_weights", "model.safetensors: not a readable safetensors file"),
    ],
)
def test_a_broken_model_folder_is_a_config_error_naming_the_file(
    hf_config: dict, tmp_path, breakage, message
) -> None:  # type: ignore[no-untyped-def]
    folder = _model_copy(hf_config["model_name"], tmp_path / "model")
    target = tmp_path / "model" / ("config.json" if breakage == "config" else "model.safetensors")
    target.unlink()
    if breakage != "no_weights":
        target.write_text("{ not json" if breakage == "config" else "garbage bytes, not a safetensors header")
    with pytest.raises(ConfigError, match=message):
        rollgen.create_generation({**hf_config, "model_name": folder})


def test_engine_settings_that_cannot_work_are_config_errors(hf_config: dict) -> None:
    with pytest.raises(ConfigError, match="above the model's context of 256"):
        rollgen.create_generation({**hf_config, "max_model_len": 4096})
    with pytest.raises(ConfigError, match="hf_kwargs"):
        rollgen.create_generation({**hf_config, "hf_kwargs": {"no_such_option": 1}})
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            rollgen.create_generation({**hf_config, "hf_cfg": {"device": "cuda"}})
    with pytest.raises(ConfigError, match="temperature: 3.0 is outside \\[-inf, 2.0\\]"):
        rollgen.create_generation({**hf_config, "backend": "vllm", "temperature": 3.0})


@pytest.mark.parametrize(
    ("key", "value", "message", "rows"),
    [
        ("temperature", [1.0, float("nan")], "finite number", [1]),
        ("top_p", [float("nan"), 0.5], "finite number", [0]),
        ("max_new_tokens", [2.7, 3.0], "must hold an integer", None),
        ("top_k", [1.5, 2.0], "must hold an integer", None),
        ("seed", [1.5, 2.0], "must hold an integer", None),
        ("top_k", [0, 5], "top_k must be -1", [0]),
        ("temperature", ["hot", "cold"], "tensor of numbers", None),
        ("max_new_tokens", [0, 3], "greater than 0", [0]),
        ("temprature", [1.0, 1.0], "did you mean 'temperature'", None),
        ("extra", 5, "unknown batch key", None),
    ],
)
def test_bad_per_sample_values_are_input_errors_before_any_engine_work(  # type: ignore[no-untyped-def]
    hf_config: dict, key, value, message, rows
) -> None:
    with rollgen.create_generation(hf_config) as gen:
        batch = {
            "input_ids": torch.tensor([[5, 6], [7, 8]]),
            "input_lengths": torch.tensor([2, 2]),
            key: value,
        }
        with pytest.raises(InputError, match=message) as info:
            gen.generate(batch)
        if rows is not None:
            assert info.value.samples == rows
