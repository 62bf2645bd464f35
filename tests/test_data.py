"""BatchedDataDict: sharding and merging, property-tested."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollgen import BatchedDataDict


def make(batch: int, width: int) -> BatchedDataDict:
    return BatchedDataDict(
        {
            "ids": torch.arange(batch * width).reshape(batch, width),
            "lengths": torch.arange(batch),
            "tags": [f"s{i}" for i in range(batch)],
        }
    )


@settings(max_examples=60)
@given(batch=st.integers(0, 40), width=st.integers(1, 6), shards=st.integers(1, 9))
def test_uneven_shard_then_merge_is_identity(batch: int, width: int, shards: int) -> None:
    data = make(batch, width)
    parts = data.shard_by_batch_size(shards, allow_uneven_shards=True)
    assert len(parts) == shards
    sizes = [p.size for p in parts]
    assert sum(sizes) == batch and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    merged = BatchedDataDict.from_batches(parts)
    assert torch.equal(merged["ids"], data["ids"]) and merged["tags"] == data["tags"]


def test_even_sharding_is_enforced_unless_allowed() -> None:
    with pytest.raises(ValueError, match="allow_uneven_shards"):
        make(5, 2).shard_by_batch_size(2)


@settings(max_examples=60)
@given(widths=st.lists(st.integers(0, 7), min_size=1, max_size=5), pad=st.integers(-3, 9))
def test_merge_pads_each_key_with_its_value(widths: list[int], pad: int) -> None:
    batches = [{"out": torch.full((2, w), 100 + i), "lp": torch.ones((2, w))} for i, w in enumerate(widths)]
    merged = BatchedDataDict.from_batches(batches, pad_value_dict={"out": pad})
    assert merged["out"].shape == (2 * len(widths), max(widths))
    for i, w in enumerate(widths):
        rows = merged["out"][2 * i : 2 * i + 2]
        assert (rows[:, :w] == 100 + i).all() and (rows[:, w:] == pad).all()
        assert (merged["lp"][2 * i : 2 * i + 2, w:] == 0).all()


def test_mismatched_batch_sizes_are_reported() -> None:
    with pytest.raises(ValueError, match="different batch sizes"):
        _ = BatchedDataDict({"a": torch.zeros(2), "b": [1, 2, 3]}).size


def test_select_and_to() -> None:
    data = make(4, 2).select_indices([3, 1])
    assert data["tags"] == ["s3", "s1"] and data["lengths"].tolist() == [3, 1]
    assert data.to("cpu")["ids"].device.type == "cpu"
