"""Refit transports and validation, across a real process boundary for shared memory."""

import multiprocessing as mp
import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import rollgen
from rollgen import RefitError
from rollgen.refit import (
    DEFAULT_BUCKET_BYTES,
    FLAT_ALIGN,
    GPU_BUCKET_BYTES,
    KEPT_LAYOUTS,
    Receiver,
    TensorMeta,
    WeightBucket,
    WeightSpec,
    bucket_groups,
    check_against_spec,
    check_reach,
    check_source,
    default_bucket_bytes,
    flat_offsets,
    flatten,
    gpu_bucket_bytes,
    iter_buckets,
    merge_buckets,
    named_tensors,
    nonfinite,
    pack_bucket,
    release_staged,
    unflatten,
)
from rollgen.testing.faults import Unreadable
from rollgen.testing.links import RecordingLink


def _receiver(conn) -> None:
    bucket = conn.recv()
    named = bucket.unpack()
    for _, t in named:
        t.add_(1)  # writes land in the sender's bucket buffer: zero-copy across processes
    conn.send([(n, t.clone()) for n, t in named])


def test_shared_memory_bucket_is_zero_copy_across_processes() -> None:
    sd = {"a": torch.zeros(4), "b": torch.arange(6, dtype=torch.bfloat16).view(2, 3)}
    bucket = next(iter_buckets(sd, "shared_memory"))
    assert len(__import__("pickle").dumps(bucket)) < 4096
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child,))
    proc.start()
    parent.send(bucket)
    received = dict(parent.recv())
    proc.join(30)
    assert torch.equal(received["a"], torch.ones(4))
    assert torch.equal(received["b"], sd["b"] + 1) and received["b"].dtype == torch.bfloat16
    assert {n: t.tolist() for n, t in bucket.unpack()} == {n: t.tolist() for n, t in received.items()}


@given(
    shapes=st.lists(st.lists(st.integers(0, 5), max_size=3), min_size=1, max_size=6),
    dtypes=st.lists(
        st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8]),
        min_size=6,
        max_size=6,
    ),
)
def test_flat_buffer_round_trips_any_dtypes_and_shapes(
    shapes: list[list[int]], dtypes: list[torch.dtype]
) -> None:
    tensors = [torch.randn(s).to(d) for s, d in zip(shapes, dtypes)]
    metas = tuple(TensorMeta.of(str(i), t) for i, t in enumerate(tensors))
    offsets = flat_offsets(m.nbytes for m in metas)
    assert all(o % FLAT_ALIGN == 0 for o in offsets)
    buf = flatten(tensors, metas, offsets, torch.device("cpu"))
    back = unflatten(buf, metas, offsets)
    assert all(b.dtype == t.dtype and torch.equal(b, t) for b, t in zip(back, tensors))
    inside = torch.zeros(len(buf) + 2 * FLAT_ALIGN, dtype=torch.uint8)[FLAT_ALIGN:-FLAT_ALIGN]
    inside.copy_(buf)  # a buffer that is a slice of a larger one
    back = unflatten(inside, metas, offsets)
    assert all(b.is_contiguous() and torch.equal(b, t) for b, t in zip(back, tensors))


def test_tied_weights_are_sent_once() -> None:
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(8, 4)
    model.head = torch.nn.Linear(4, 8, bias=False)
    model.head.weight = model.embed.weight
    assert [m.name for b in iter_buckets(model, "tensors") for m in b.metas] == ["embed.weight"]


def test_only_a_tensor_that_is_another_under_a_second_name_is_dropped() -> None:
    """Tensors at one address are one only where they are read the same way (``named_tensors``
    compares them whole only when their addresses meet)."""
    w = torch.arange(12.0).reshape(3, 4)
    source = {
        "w": w,
        "tied": w,  # the same tensor again: dropped
        "same_view": w.view(3, 4),  # another object, read the same way: dropped
        "first_row": w[0],  # the same address, another shape: kept
        "transposed": w.t(),  # the same address, other strides: kept
        "copy": w.clone(),  # the same values elsewhere: kept
        "empty_a": torch.empty(0),
        "empty_b": torch.empty(0),  # empty tensors are never dropped
    }
    assert [n for n, _ in named_tensors(source)] == [
        "w",
        "first_row",
        "transposed",
        "copy",
        "empty_a",
        "empty_b",
    ]


def test_buckets_are_bounded_and_cast() -> None:
    sd = {f"w{i}": torch.zeros(256) for i in range(10)}  # 1 KiB each in fp32
    buckets = list(iter_buckets(sd, "tensors", bucket_bytes=1500, dtype=torch.bfloat16))
    assert [len(b.metas) for b in buckets] == [2, 2, 2, 2, 2]  # names w0..w9 share no module group
    assert all(m.dtype == "bfloat16" for b in buckets for m in b.metas)


def test_validation_lists_every_problem() -> None:
    spec = WeightSpec({"a": ((2,), "float32"), "b": ((3,), "float32"), "d": ((1,), "float32")})
    metas = [
        TensorMeta("a", (3,), "float32"),
        TensorMeta("b", (3,), "bfloat16"),
        TensorMeta("c", (1,), "float32"),
    ]
    with pytest.raises(RefitError) as info:
        check_against_spec(metas, spec)
    assert len(info.value.problems) == 4, info.value.problems
    assert "d: missing (pass partial=True" in str(info.value)


def test_an_update_covers_the_model_or_whole_module_groups_of_it() -> None:
    """Every tensor, a tied one under either of its names; ``partial``: the module groups sent,
    whole (engines fuse q/k/v and gate/up within one)."""
    shapes = {
        "model.layers.0.self_attn.q_proj.weight": ((2,), "float32"),
        "model.layers.0.self_attn.k_proj.weight": ((2,), "float32"),
        "model.layers.0.mlp.up_proj.weight": ((2,), "float32"),
        "model.embed_tokens.weight": ((2,), "float32"),
        "lm_head.weight": ((2,), "float32"),
    }
    spec = WeightSpec(shapes, tied={"lm_head.weight": "model.embed_tokens.weight"})
    attn = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"]
    everything = [*attn, "model.layers.0.mlp.up_proj.weight", "lm_head.weight"]
    assert spec.missing(everything) == [], "the tied embedding is sent as lm_head.weight"
    assert spec.missing(attn) == [
        "model.layers.0.mlp.up_proj.weight",
        "model.embed_tokens.weight",
        "lm_head.weight",
    ]
    assert spec.missing(attn, partial=True) == []
    assert spec.missing(attn[:1], partial=True) == attn[1:], "half a fused group is refused"
    assert spec.missing(iter(attn[:1]), partial=True) == attn[1:], "names may come as an iterator"
    check_against_spec([TensorMeta(n, (2,), "float32") for n in attn], spec, partial=True)


def test_non_finite_tensors_are_named_while_packing() -> None:
    good, nan = torch.ones(3), torch.tensor([1.0, float("nan")])
    inf = torch.tensor([float("inf")], dtype=torch.bfloat16)
    huge = torch.full((4,), 1e30)  # finite, but its 2-norm overflows: checked element-wise
    assert nonfinite([("a", good), ("b", nan), ("c", torch.arange(3)), ("d", inf), ("e", huge)]) == ["b", "d"]
    wide = [("f", torch.full((2,), 1e300, dtype=torch.float64)), ("g", nan.double()), ("h", good)]
    assert nonfinite(wide) == ["g"], "float64 tensors are checked in float64, beside the others"
    with pytest.raises(RefitError, match="NaN or infinite") as info:
        pack_bucket([("a", good), ("b", nan)], "tensors")
    assert info.value.problems == ["b"]
    big = torch.tensor([1e5])
    with pytest.raises(RefitError) as cast:
        pack_bucket([("big", big)], "tensors", dtype=torch.float16)  # overflows in the cast
    assert cast.value.problems == ["big"]
    assert pack_bucket([("b", nan)], "tensors", check_finite=False).metas[0].name == "b"


@pytest.mark.parametrize("source", [None, [torch.ones(1)], {"a": [1.0]}, {1: torch.ones(1)}])
def test_a_bad_refit_source_is_a_refit_error(source: object) -> None:
    with pytest.raises(RefitError, match="refit source|state dict maps"):
        check_source(source)


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "1"])
def test_a_bad_bucket_size_is_a_refit_error(size: object) -> None:
    with pytest.raises(RefitError, match="bucket_bytes"):
        list(iter_buckets({"a": torch.ones(1)}, "tensors", bucket_bytes=size))  # type: ignore[arg-type]


def test_buckets_of_a_tensor_without_values_or_with_a_cast_to_no_dtype_are_refused() -> None:
    with pytest.raises(RefitError, match="meta device"):
        list(iter_buckets({"a": torch.ones(1), "b": torch.empty(2, device="meta")}, "tensors"))
    with pytest.raises(RefitError, match=r"got 'bfloat16' \(pass torch.bfloat16\)"):
        list(iter_buckets({"a": torch.ones(1)}, "tensors", dtype="bfloat16"))  # type: ignore[arg-type]


def test_refit_matches_independent_hf(hf_config: dict) -> None:
    """Refit the HF engine with perturbed weights; logprobs follow an independent HF model."""
    from rollgen.output import generated_mask
    from rollgen.testing import load_reference_model, teacher_forced_logprobs
    from rollgen.testing.reference import agreement

    new = load_reference_model(hf_config["model_name"])
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "input_lengths": torch.tensor([4])}
    with rollgen.create_generation(hf_config) as engine:
        engine.refit(new.state_dict())
        out = engine.generate(batch)
    ref = teacher_forced_logprobs(
        new, out["output_ids"], batch["input_lengths"], out["unpadded_sequence_lengths"]
    )
    assert agreement(out["logprobs"], ref, generated_mask(out, batch["input_lengths"]))["max_abs"] < 1e-4


def test_buckets_never_split_a_module_group() -> None:
    sd = {f"model.layers.0.self_attn.{p}_proj.weight": torch.zeros(256) for p in "qkvo"}
    sd["model.norm.weight"] = torch.zeros(256)
    buckets = list(iter_buckets(sd, "tensors", bucket_bytes=1500))
    assert [len(b.metas) for b in buckets] == [4, 1]


def test_default_bucket_size_is_a_quarter_of_the_gpus_free_memory_within_bounds() -> None:
    low, high = GPU_BUCKET_BYTES
    assert gpu_bucket_bytes(64 << 30) == gpu_bucket_bytes(16 << 30) == high == 4 << 30
    assert gpu_bucket_bytes(2 << 30) == 512 << 20
    assert gpu_bucket_bytes(100 << 20) == low == 64 << 20
    # host memory, or nothing to send: the fixed default
    assert default_bucket_bytes({"w": torch.zeros(4)}) == DEFAULT_BUCKET_BYTES
    assert default_bucket_bytes({}) == DEFAULT_BUCKET_BYTES
    sd = {f"model.layers.{i}.mlp.up_proj.weight": torch.zeros(256) for i in range(3)}
    assert [len(b.metas) for b in iter_buckets(sd, "tensors")] == [3]


def test_refit_resets_the_prefix_cache_only_after_a_generate(hf_config: dict) -> None:
    """Prefixes are cached only by generate calls, and a sleep resets them; a refit's reset (an
    engine round trip, O(KV blocks) in vLLM) is due only when a generate ran since the last one."""
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "input_lengths": torch.tensor([4])}
    with rollgen.create_generation(hf_config) as engine:
        link = engine.updates.link = RecordingLink(engine.updates.link)

        def resets() -> list[int]:  # a reset on its own, or with the last bucket
            return [1 for c in link.calls if c == ("reset",) or (c[0] == "apply" and c[2])]

        weights = {n: torch.zeros(s, dtype=getattr(torch, d)) for n, (s, d) in engine.weight_spec.items()}
        engine.refit(weights)
        assert resets() == []
        engine.generate(batch)
        engine.refit(weights)
        engine.update_weights(iter_buckets(weights, "tensors"))
        assert resets() == [1]
        engine.generate(batch)
        engine.update_weights(iter_buckets(weights, "tensors"))
        assert resets() == [1, 1]
        engine.generate(batch)
        engine.finish_generation()  # the colocated loop: the sleep resets the cache itself
        engine.prepare_for_generation(["weights"])
        engine.refit(weights)
        engine.prepare_for_generation(["kv_cache"])
        assert resets() == [1, 1]


def test_a_refit_that_fails_part_way_marks_the_generation_stale(hf_config: dict) -> None:
    """The last bucket holds a tensor that cannot be read (a stand-in: it passes the name,
    shape and dtype checks, then the engine fails to copy it). The buckets before it were
    applied, so the engine holds mixed weights: generate refuses until a complete refit."""
    from rollgen import StaleWeights
    from rollgen.testing import load_reference_model

    batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "input_lengths": torch.tensor([4])}
    state = load_reference_model(hf_config["model_name"]).state_dict()
    broken = {**state, "lm_head.weight": state["lm_head.weight"].clone().as_subclass(Unreadable)}
    with rollgen.create_generation(hf_config) as engine:
        before = engine.generate(batch, greedy=True)
        with pytest.raises(RuntimeError, match="injected fault"):
            engine.refit(broken, bucket_bytes=64 << 10, check_finite=False)
        with pytest.raises(StaleWeights, match="refit failed at bucket"):
            engine.generate(batch, greedy=True)
        engine.refit(state)
        assert torch.equal(engine.generate(batch, greedy=True)["output_ids"], before["output_ids"])


def test_a_rejected_refit_leaves_the_engine_serving(hf_config: dict) -> None:
    """NaN weights, a missing tensor, a bad source, a tensor without values (on the meta
    device), a cast to what is not a dtype: RefitError before anything is applied."""
    from rollgen.testing import load_reference_model

    batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "input_lengths": torch.tensor([4])}
    state = load_reference_model(hf_config["model_name"]).state_dict()
    nan = {**state, "model.norm.weight": torch.full_like(state["model.norm.weight"], float("nan"))}
    with rollgen.create_generation(hf_config) as engine:
        before = engine.generate(batch, greedy=True)
        with pytest.raises(RefitError) as info:
            engine.refit(nan)
        assert info.value.problems == ["model.norm.weight"]
        with pytest.raises(RefitError, match="lm_head.weight: missing"):
            engine.refit({k: v for k, v in state.items() if k != "lm_head.weight"})
        with pytest.raises(RefitError, match="refit source"):
            engine.refit(None)  # type: ignore[arg-type]
        meta = {**state, "model.norm.weight": torch.empty_like(state["model.norm.weight"], device="meta")}
        with pytest.raises(RefitError, match="meta device") as empty:
            engine.refit(meta)
        assert empty.value.problems == ["model.norm.weight"]
        for dtype in ["float32", torch.int8, 32]:
            with pytest.raises(RefitError, match=r"dtype must be None \(no cast\) or one of torch.float32"):
                engine.refit(state, dtype=dtype)  # type: ignore[arg-type]
        with pytest.raises(RefitError, match="update_weights takes"):
            engine.update_weights(None)  # type: ignore[arg-type]
        assert torch.equal(engine.generate(batch, greedy=True)["output_ids"], before["output_ids"])


def test_the_prefix_reset_comes_with_the_last_bucket(hf_config: dict) -> None:
    """A refit after a generate asks the link to load its last bucket with the prefix-cache reset
    (engines reached over a round trip do both in one call), the others without; a refit after
    no generate resets nothing; a NaN output makes the next complete refit clear the KV cache."""
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "input_lengths": torch.tensor([4])}
    with rollgen.create_generation(hf_config) as engine:
        link = RecordingLink(engine.updates.link)
        engine.updates.link = link
        weights = {n: torch.zeros(s, dtype=getattr(torch, d)) for n, (s, d) in engine.weight_spec.items()}
        count = len(list(bucket_groups(weights, 1 << 14)))
        assert count > 2
        engine.generate(batch)
        engine.refit(weights, bucket_bytes=1 << 14)
        assert link.calls == [("apply", "", False)] * (count - 1) + [("apply", "", True)]
        link.calls.clear()
        engine.refit(weights, bucket_bytes=1 << 14)
        assert link.calls == [("apply", "", False)] * count
        link.calls.clear()
        engine.updates.kv_poisoned = True  # as a generate that returned NaN logprobs leaves it
        engine.refit(weights, bucket_bytes=1 << 14)
        assert link.calls == [("apply", "", False)] * count + [("clear",)]
        assert not engine.updates.kv_poisoned


def test_a_kept_layouts_unpacked_tensors_are_held_until_released() -> None:
    """A rank's receiver keeps what it unpacked of a kept layout's bucket (views of a mapping it
    keeps) under the layout's name: later requests of the layout, by name alone or with the
    pickle again, get the same tensors; a name it does not hold asks for the pickle (None); it
    lets go on ``release``, and keeps the ``capacity`` layouts used last. Other buckets are
    unpacked anew each time."""
    tensors = [torch.arange(4.0), torch.ones(2, 2)]
    metas = tuple(TensorMeta.of(n, t) for n, t in zip("ab", tensors))
    staged = pickle.dumps(WeightBucket("tensors", metas, tensors, layout="L"))
    plain = pickle.dumps(WeightBucket("tensors", metas, tensors))
    receiver = Receiver(capacity=3)
    assert receiver.unpack("L", None) is None
    first, kept = receiver.unpack("L", staged)
    again, kept_again = receiver.unpack("L", None)
    assert kept and kept_again and again is first and [n for n, _ in first] == ["a", "b"]
    assert receiver.unpack("L", staged) == (first, True)
    other, not_kept = receiver.unpack("", plain)
    assert not not_kept and receiver.unpack("", plain)[0] is not other
    receiver.release([])
    assert receiver.unpack("L", None) is None
    assert receiver.unpack("L", staged)[0] is not first
    for i in range(3):  # L, used after each of these, stays; the first of them goes
        layout = f"L{i}"
        receiver.unpack(layout, pickle.dumps(WeightBucket("tensors", metas, tensors, layout=layout)))
        receiver.unpack("L", None)
    assert receiver.unpack("L0", None) is None and receiver.unpack("L", None) is not None
    assert Receiver().kept.capacity == KEPT_LAYOUTS


def test_a_layout_refitted_before_skips_no_check_that_another_layout_needs(hf_config: dict) -> None:
    """refit keeps the checks of the last layout that passed (a trainer refits the same layout
    every step) and its buckets: the same layout again is loaded exactly (new values, other bucket
    sizes too); any change of a name, shape, dtype or ``partial`` is checked afresh, and the
    values always are."""
    from rollgen.testing import load_reference_model

    batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "input_lengths": torch.tensor([4])}
    state = {k: v.clone() for k, v in load_reference_model(hf_config["model_name"]).state_dict().items()}
    other = load_reference_model(rollgen.testing.tiny_model_dir(trained=False)).state_dict()
    with rollgen.create_generation(hf_config) as engine:
        before = engine.generate(batch, greedy=True)
        engine.refit(state)
        engine.refit(other, bucket_bytes=1 << 12)  # the same layout, other values and buckets
        changed = engine.generate(batch, greedy=True)
        assert not torch.equal(changed["output_ids"], before["output_ids"])
        wide = {**state, "model.norm.weight": torch.ones(state["model.norm.weight"].shape[0] + 1)}
        with pytest.raises(RefitError, match=r"model.norm.weight: shape"):
            engine.refit(wide)
        with pytest.raises(RefitError, match=r"model.norm.weight: dtype"):
            engine.refit({**state, "model.norm.weight": state["model.norm.weight"].double()})
        with pytest.raises(RefitError, match="lm_head.weight: missing"):
            engine.refit({k: v for k, v in state.items() if k != "lm_head.weight"})
        with pytest.raises(RefitError, match="missing; a partial update sends whole module groups"):
            engine.refit(
                {"model.layers.0.self_attn.q_proj.weight": state["model.layers.0.self_attn.q_proj.weight"]},
                partial=True,
            )
        nan = {**state, "model.norm.weight": torch.full_like(state["model.norm.weight"], float("nan"))}
        with pytest.raises(RefitError, match="NaN"):
            engine.refit(nan)  # the layout that passed before: its values are checked all the same
        assert torch.equal(engine.generate(batch, greedy=True)["output_ids"], changed["output_ids"])
        engine.refit(state)
        assert torch.equal(engine.generate(batch, greedy=True)["output_ids"], before["output_ids"])


def ipc_stand_in(gpus: list[str], names: tuple[str, ...] = ("a", "b")) -> WeightBucket:
    """A cuda_ipc bucket whose payload maps GPU UUIDs to placeholders: a stand-in for the CUDA
    IPC handles this CPU machine cannot make (merging and checking read only their keys)."""
    metas = tuple(TensorMeta(n, (2,), "float32") for n in names)
    return WeightBucket("cuda_ipc", metas, {gpu: f"handle-on-{gpu}" for gpu in gpus}, flat_offsets([8, 8]))


def test_buckets_of_colocated_trainer_ranks_merge_into_one_update_with_every_gpus_handle() -> None:
    merged = merge_buckets([[ipc_stand_in(["GPU-0"])] * 2, [ipc_stand_in(["GPU-1"])] * 2])
    assert len(merged) == 2 and all(
        b.payload == {"GPU-0": "handle-on-GPU-0", "GPU-1": "handle-on-GPU-1"} for b in merged
    )
    check_reach(merged[0], ["GPU-0", "GPU-1"])


def test_merging_refuses_ranks_that_packed_differently_or_share_a_gpu() -> None:
    with pytest.raises(RefitError, match="different numbers of buckets"):
        merge_buckets([[ipc_stand_in(["GPU-0"])], []])
    with pytest.raises(RefitError, match="rank 1 packed other tensors"):
        merge_buckets([[ipc_stand_in(["GPU-0"])], [ipc_stand_in(["GPU-1"], ("a", "c"))]])
    with pytest.raises(RefitError, match="rank 1 is on GPU"):
        merge_buckets([[ipc_stand_in(["GPU-0"])], [ipc_stand_in(["GPU-0"])]])


def test_an_ipc_update_that_misses_an_engine_gpu_is_refused_naming_the_topology() -> None:
    with pytest.raises(RefitError, match="engines run on GPUs") as err:
        check_reach(ipc_stand_in(["GPU-0"]), ["GPU-0", "GPU-1"])
    assert err.value.problems == ["no handle for engine GPU GPU-1"]
    check_reach(WeightBucket("tensors", (), []), ["GPU-0"])  # other transports reach every engine


def test_the_packed_bytes_check_finds_what_the_per_tensor_check_finds() -> None:
    """Staging buffers are checked with one sum over the packed bytes (their padding included):
    a NaN or infinity in a tensor is named; a NaN pattern left in the padding (another layout's
    bytes), a sum that overflows or mixed dtypes only send it to the exact per-tensor check."""
    from rollgen.refit.staging import _Layout, _require_finite

    def layout(tensors: list[torch.Tensor]) -> _Layout:
        metas = tuple(TensorMeta.of(n, t) for n, t in zip("abc", tensors))
        offsets = flat_offsets(m.nbytes for m in metas)
        buf = torch.zeros(offsets[-1], dtype=torch.uint8)
        views = unflatten(buf, metas, offsets)
        for view, t in zip(views, tensors):
            view.copy_(t)
        return _Layout(WeightBucket("cuda_ipc", metas, {}, offsets, layout="L"), [buf], views)

    bf16 = [torch.randn(3, dtype=torch.bfloat16), torch.randn(5, dtype=torch.bfloat16)]
    _require_finite(layout(bf16))
    nan = layout([bf16[0], torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)])
    with pytest.raises(RefitError) as info:
        _require_finite(nan)
    assert info.value.problems == ["b"]
    padded = layout(bf16)
    padded.buffers[0][6:8] = torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.uint8)
    _require_finite(padded)  # the sum is NaN, the tensors are not
    _require_finite(layout([torch.full((4,), 3e38), torch.full((4,), 3e38)]))  # the sum overflows
    with pytest.raises(RefitError) as mixed:
        _require_finite(layout([torch.ones(2, dtype=torch.float64), torch.tensor([float("inf")])]))
    assert mixed.value.problems == ["b"]


def test_in_place_views_rebuild_each_tensor_where_it_lies_in_its_storage() -> None:
    """What a receiver reads in place: each tensor at its byte offset and strides in its
    storage (slices of one flat tensor, a transposed view, a tensor of its own), sharing its
    bytes. The receiver's mapping of each storage is stood in for by the storage itself (CUDA
    IPC has no CPU form)."""
    from rollgen.refit import InPlaceViews, IpcHandle
    from rollgen.refit.in_place import bytes_of, storage_places
    from rollgen.refit.transports import cuda_ipc

    flat = torch.arange(24, dtype=torch.float32)
    own = torch.randn(2, 3, dtype=torch.bfloat16)
    named = [("a", flat[2:8].view(2, 3)), ("b", flat[10:22].view(3, 4).t()), ("c", own), ("d", flat[:2])]
    storages, places = storage_places(named)
    assert len(storages) == 2 and [p[0] for p in places] == [0, 0, 1, 0]
    keys = [f"test:{i}" for i in range(len(storages))]
    cuda_ipc._staged.update({k: bytes_of(s) for k, s in zip(keys, storages)})  # the stand-in mappings
    try:
        handles = tuple(IpcHandle(torch.empty, (), k) for k in keys)
        views = InPlaceViews(handles, places).views([TensorMeta.of(n, t) for n, t in named], 0)
        for (_, t), v in zip(named, views):
            assert torch.equal(v, t) and v.stride() == t.stride() and v.data_ptr() == t.data_ptr()
    finally:
        release_staged(keys)


def test_in_place_refits_take_only_the_last_refits_very_tensors(monkeypatch) -> None:
    """A refit goes in place only with the tensors of the refit before it (or those read in
    place already): the same names, storages, places, shapes and strides (a module's state dict
    anew counts: the same storages), contiguous, uncast. A training step in place keeps them;
    a parameter given new storage, a renamed entry, a view, or a cast do not. The GPU check is
    stood in for (these tensors are on the CPU), and so is the export (CUDA IPC has no CPU
    form): one that fails is a RefitError, and the generation's later refits are staged."""
    from rollgen.refit import in_place
    from rollgen.refit.in_place import InPlaceSources

    model = torch.nn.Linear(3, 2)
    named = lambda: list(model.state_dict().items())  # noqa: E731 - read anew, as refit does
    sources = InPlaceSources()
    assert not sources.applies(named(), None, ("GPU-0",))  # nothing noted yet
    sources.note(named())
    assert not sources.applies(named(), None, ("GPU-0",))  # on the CPU: not on the engines' GPU
    monkeypatch.setattr(in_place, "on_engine_gpu", lambda tensors, devices: True)
    assert sources.applies(named(), None, ("GPU-0",))
    with torch.no_grad():
        model.weight.add_(1)  # a training step in place: still the same tensors
    assert sources.applies(named(), None, ("GPU-0",))
    assert not sources.applies(named(), torch.float16, ("GPU-0",))  # a cast
    renamed = [(f"x.{n}", t) for n, t in named()]
    assert not sources.applies(renamed, None, ("GPU-0",))
    viewed = [(n, t[:1]) for n, t in named()]
    assert not sources.applies(viewed, None, ("GPU-0",))
    model.weight.data = model.weight.data.clone()
    assert not sources.applies(named(), None, ("GPU-0",))

    def no_export(*args: object) -> None:
        raise RuntimeError("this memory cannot be shared")

    sources.note(named())
    monkeypatch.setattr(in_place.InPlaceSources, "_export", no_export)
    with pytest.raises(RefitError, match="cannot share the trainer's tensors"):
        sources.pack(named(), 1, True)
    assert not sources.applies(named(), None, ("GPU-0",)) and not sources.keys


def test_in_place_refits_check_the_tensors_by_a_check_kept_for_them(monkeypatch, caplog) -> None:
    """A checked refit in place rejects NaN or infinite values before anything is sent, by a
    check made once for the tensors read in place (a CUDA graph, ``GraphedCheck``: stood in for
    here, as are the export and the device sync, which need a GPU); where torch cannot capture
    the graph, the plain check serves, with a warning."""
    import logging

    from rollgen.refit import in_place
    from rollgen.refit.in_place import InPlaceSources, _Sources

    made = []

    class Check:  # stand-in for GraphedCheck, with nonfinite's answers
        def __init__(self, named: list) -> None:
            made.append(named)
            self.nonfinite = lambda: nonfinite(named)

    def export(self: InPlaceSources, named: list, receivers: int) -> _Sources:
        return _Sources(WeightBucket("tensors", (), [], layout="L"), in_place._fingerprint(named), [], [b""])

    monkeypatch.setattr(in_place, "GraphedCheck", Check)
    monkeypatch.setattr(in_place.InPlaceSources, "_export", export)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    weight = torch.ones(3)
    named = [("w", weight)]
    sources = InPlaceSources()
    assert sources.pack(named, 1, True) is sources.pack(named, 1, True)
    assert len(made) == 1
    weight[1] = float("nan")
    with pytest.raises(RefitError, match="1 tensor\\(s\\) hold NaN or infinite values") as info:
        sources.pack(named, 1, True)
    assert info.value.problems == ["w"]
    sources.pack(named, 1, False)  # unchecked
    sources.release()

    def no_graph(named: list) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(in_place, "GraphedCheck", no_graph)
    with (
        caplog.at_level(logging.WARNING, "rollgen.refit.in_place"),
        pytest.raises(RefitError, match="hold NaN"),
    ):
        sources.pack(named, 1, True)
    assert "runs unreplayed: operation not permitted" in caplog.text
