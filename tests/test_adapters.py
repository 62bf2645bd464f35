"""LoRA adapters refitted alone (``rollgen.refit.adapters``, the hf backend's ``LoraLayers``):
the spec in PEFT's names, sources a trainer has (a PEFT model, its state dict, a PEFT folder), the
versions an engine holds, rows of one batch on different versions, and the server serving the
current adapter on every route."""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch

import rollgen
from rollgen.errors import ConfigError, InputError, RefitError, UnsupportedCapability
from rollgen.refit.adapters import PEFT_PREFIX, AdapterSpec, AdapterVersions, read_peft_folder
from rollgen.testing import load_reference_model, tiny_config, tiny_model_dir, versioned_logprob_error
from rollgen.testing.prompts import PROMPTS, encode
from rollgen.testing.reference import merged_reference, next_token_logprobs, random_adapter, scored_logprobs

LORA = {"rank": 4, "alpha": 8.0, "max_versions": 3}
KEY = "adapter-key-" + "0" * 24


@pytest.fixture(scope="module")
def gen() -> Iterator[Any]:
    with rollgen.create_generation({**tiny_config("hf", max_new_tokens=8), "lora": LORA}) as g:
        yield g


@pytest.fixture(scope="module")
def spec(gen: Any) -> AdapterSpec:
    return AdapterSpec.of(LORA, gen.weight_spec)


@pytest.fixture(scope="module")
def batch(gen: Any) -> dict[str, torch.Tensor]:
    return encode(gen.tokenizer, PROMPTS)


def test_the_spec_is_peft_names_and_shapes(gen: Any, spec: AdapterSpec) -> None:
    q = gen.weight_spec["model.layers.0.self_attn.q_proj.weight"][0]
    a = spec.weights[f"{PEFT_PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = spec.weights[f"{PEFT_PREFIX}model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert a == ((4, q[1]), "float32") and b == ((q[0], 4), "float32")
    layers = {n.split(".")[2] for n in gen.weight_spec if n.startswith("model.layers.")}
    assert len(spec.layers) == 7 * len(layers) and spec.scaling == 2.0
    only_q = AdapterSpec.of({"rank": 2, "target_modules": ["q_proj"]}, gen.weight_spec)
    assert {n.rpartition(".")[2] for n in only_q.layers} == {"q_proj"}
    assert only_q.scaling == 1.0, "alpha defaults to the rank"
    with pytest.raises(ConfigError, match="name no linear layer"):
        AdapterSpec.of({"rank": 2, "target_modules": ["qkv"]}, gen.weight_spec)
    with pytest.raises(ConfigError, match="embedding"):
        AdapterSpec.of({"rank": 2, "target_modules": ["embed_tokens"]}, gen.weight_spec)


def test_a_backend_without_adapters_refuses_the_config() -> None:
    with pytest.raises(UnsupportedCapability, match="adapters"):
        rollgen.create_generation({**tiny_config("example", max_new_tokens=4), "lora": LORA})


def test_an_engine_without_lora_refuses_an_adapter_refit(spec: AdapterSpec) -> None:
    with rollgen.create_generation(tiny_config("hf", max_new_tokens=4)) as plain:
        with pytest.raises(RefitError, match="name a LoRA setup in the config's lora"):
            plain.refit(random_adapter(spec, seed=1), target="adapter")


def test_versions_in_use_are_never_dropped() -> None:
    versions = AdapterVersions(capacity=3)
    for v in (1, 2, 3):
        assert versions.to_drop(in_use=set()) == []
        versions.added(v)
    assert versions.current == 3
    assert versions.to_drop(in_use={1}) == [2], "the oldest not in use goes"
    assert versions.to_drop(in_use=set()) == [1]
    with pytest.raises(RefitError, match="lora.max_versions=3"):
        versions.to_drop(in_use={1, 2})


def test_targets_and_bucket_counts(gen: Any, spec: AdapterSpec) -> None:
    adapter = random_adapter(spec, seed=1)
    with pytest.raises(InputError, match="refit target 'lora'"):
        gen.refit(adapter, target="lora")
    two = list(rollgen.iter_buckets(adapter, "tensors", bucket_bytes=1 << 10))
    assert len(two) > 1
    with pytest.raises(RefitError, match="one bucket"):
        gen.update_weights(two, target="adapter")
    with pytest.raises(RefitError, match="not a tensor of the engine's adapter"):
        gen.refit({k.replace(PEFT_PREFIX, ""): v for k, v in adapter.items()}, target="adapter")


def test_update_weights_takes_an_adapter_packed_elsewhere(gen: Any, spec: AdapterSpec, batch: Any) -> None:
    adapter = random_adapter(spec, seed=3)
    (bucket,) = rollgen.iter_buckets(adapter, gen.local_transport)
    gen.update_weights(bucket, target="adapter")
    packed = gen.generate(batch, greedy=True)
    gen.refit(adapter, target="adapter")
    refitted = gen.generate(batch, greedy=True)
    assert torch.equal(packed["output_ids"], refitted["output_ids"])
    assert torch.allclose(packed["logprobs"], refitted["logprobs"], atol=1e-6)


def test_a_peft_model_and_its_folder_serve_the_merged_model(gen: Any, batch: Any, tmp_path: Any) -> None:
    """A PEFT model as the source (its active adapter), and the folder it saves (its setup for
    the config, its tensors for the refit): the engine serves what PEFT's own merge computes."""
    from peft import LoraConfig, get_peft_model

    setup = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    peft_model = get_peft_model(load_reference_model(tiny_model_dir()), setup)
    peft_model.save_pretrained(tmp_path)
    lora, tensors = read_peft_folder(tmp_path)
    assert lora == {"rank": 4, "alpha": 8.0, "target_modules": ["down_proj", "q_proj", "v_proj"]}
    with rollgen.create_generation({**tiny_config("hf", max_new_tokens=8), "lora": lora}) as engine:
        merged = copy.deepcopy(peft_model).merge_and_unload()
        for source in (peft_model, tensors):
            engine.refit(source, target="adapter")
            out = engine.generate(batch, greedy=True)
            ref = scored_logprobs(
                next_token_logprobs(merged, out["output_ids"], out["unpadded_sequence_lengths"]),
                out["output_ids"],
                batch["input_lengths"],
                out["unpadded_sequence_lengths"],
            )
            mask = out["logprobs"] != 0
            assert (out["logprobs"][mask] - ref[mask]).abs().max() < 1e-4
    with pytest.raises(ConfigError, match="not a PEFT adapter folder"):
        read_peft_folder(tmp_path / "nothing")


def test_rows_of_one_batch_decode_with_their_own_versions(gen: Any, spec: AdapterSpec, batch: Any) -> None:
    """``LoraLayers.bound``: rows on different versions (or none) in one forward give each row
    what a forward of its version alone gives."""
    first, second = random_adapter(spec, seed=1), random_adapter(spec, seed=2)
    layers = gen.adapters
    layers.load(101, list(first.items()))
    layers.load(102, list(second.items()))
    ids, mask = batch["input_ids"][:3], torch.ones_like(batch["input_ids"][:3])
    try:
        with torch.no_grad():
            mixed = layers.bound([101, None, 102])(input_ids=ids, attention_mask=mask).logits
            for row, version in enumerate((101, None, 102)):
                alone = layers.bound([version])(
                    input_ids=ids[row : row + 1], attention_mask=mask[row : row + 1]
                )
                assert torch.allclose(mixed[row], alone.logits[0], atol=1e-5), (
                    f"row {row} (version {version})"
                )
    finally:
        layers.drop(101)
        layers.drop(102)


def test_the_server_serves_the_current_adapter_on_every_route(gen: Any, spec: AdapterSpec) -> None:
    """Completions and chat (in a session) after an adapter refit: every token's logprob is the
    merged model's of its version, and the versions say which."""
    adapter = random_adapter(spec, seed=5)
    gen.refit(adapter, target="adapter")
    version = gen.weight_version
    merged = merged_reference(tiny_model_dir(), adapter, spec)
    with rollgen.serve(gen, api_key=KEY) as server:
        client = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)
        done = client.completions.create(
            model=server.model_id, prompt="count: 1 2", temperature=0, logprobs=0
        )
        chat = client.chat.completions.create(
            model=server.model_id,
            messages=[{"role": "user", "content": "abc: a b"}],
            temperature=0,
            extra_body={"session_id": "adapter"},
        )
        for label, choice in (("completion", done.choices[0]), ("chat", chat.choices[0])):
            fields = choice.model_extra["rollgen"]
            assert {s["version"] for s in fields["versions"]} == {version}, label
            start = len(fields["prompt_token_ids"])
            spans = [{**s, "start": s["start"] + start, "end": s["end"] + start} for s in fields["versions"]]
            error = versioned_logprob_error(
                fields["prompt_token_ids"] + fields["token_ids"],
                [None] * start + fields["logprobs"],
                spans,
                {version: merged},
            )
            assert error < 1e-4, f"{label}: logprobs are not the merged model's ({error})"


def test_work_on_a_stepped_engine_runs_between_its_steps() -> None:
    """``StepLoop.call`` (how an adapter loads while samples run): in the caller's thread before
    the loop has one, else on the loop's thread, never while a step runs, with a sample still
    running; its error is raised to the caller; after ``stop``, EngineClosed."""
    from rollgen.errors import EngineClosed
    from rollgen.rollout import SampleRequest
    from rollgen.sampling import SampleParams
    from rollgen.streaming_loop import StepLoop

    entered, in_step = threading.Event(), threading.Event()

    def step() -> list[Any]:
        in_step.set()
        entered.set()
        in_step.clear()
        return [("a", [1], [-0.5], False)]  # never ends: the loop keeps stepping

    loop = StepLoop(lambda requests: None, step, lambda keys: None, lambda ended: None, "test-loop")
    assert loop.call(threading.current_thread) is threading.current_thread()
    loop.start([SampleRequest("a", (1, 2), SampleParams(1.0, 1.0, -1, 30, (), (), None))])
    assert entered.wait(timeout=60), "the loop never stepped"
    seen = loop.call(lambda: (threading.current_thread().name, in_step.is_set()))
    assert seen == ("test-loop", False)
    with pytest.raises(KeyError, match="missing"):
        loop.call(lambda: {}["missing"])
    loop.stop()
    with pytest.raises(EngineClosed):
        loop.call(lambda: None)


def test_streamed_samples_of_different_versions_decode_apart() -> None:
    """hf's ``Cohorts``: one decoder per adapter version among the samples started together (a
    decoder steps its finished rows until all end; a version no running sample uses may be
    dropped meanwhile, so no decoder may hold rows of another version)."""
    from rollgen.rollout import SampleRequest
    from rollgen.sampling import SampleParams
    from rollgen_hf.decode import Cohorts

    made: list[list[int | None]] = []

    def decoder(requests: list[SampleRequest]) -> Any:
        made.append([r.params.adapter for r in requests])
        return None

    params = SampleParams(1.0, 1.0, -1, 4, (), (), None)
    versions = [1, None, 1, 2]
    Cohorts(decoder).add(
        [SampleRequest(f"k{i}", (1,), dataclasses.replace(params, adapter=v)) for i, v in enumerate(versions)]
    )
    assert made == [[1, 1], [None], [2]]
