"""What the conformance suite holds a backend to: the stated bounds and the checks that use them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import pytest
import torch

from rollgen.errors import UnsupportedCapability
from rollgen.output import generated_mask
from rollgen.spec import Capability
from rollgen.testing.reference import agreement, next_token_logprobs, scored_logprobs

#: Stated agreement bounds with the teacher-forced HF reference (run in fp32 or bf16 on CPU), per
#: engine dtype. CUDA engines in fp32 use TF32 tensor-core matmuls and other kernels than the CPU
#: reference: measured max |Δlogp| 1.4e-3 with vLLM 0.26 on an H200 (docs/gpu-results.md).
BOUNDS = {
    "float32": {"max_abs": 1e-4, "token_mult_prob_error": 1.0001},
    "float32-cuda": {"max_abs": 5e-3, "token_mult_prob_error": 1.002},
    "bfloat16": {"max_abs": 0.08, "token_mult_prob_error": 1.02},
}
#: Repeated greedy calls (and a refit back to the same weights) give the same tokens, and fp32
#: logprobs within this. CUDA kernels are not bitwise reproducible from call to call: measured up
#: to 1.7e-5 at TP=2 and 6e-7 at TP=1 (vLLM 0.26, fp32, H200s; docs/gpu-results.md, 2026-11-30, 60a5faf).
REPEAT_MAX_ABS = {"cpu": 1e-5, "cuda": 1e-4}
#: In bf16 a generated token may differ from the reference argmax only on a near-tie.
BF16_TIE_GAP = 0.05


E = TypeVar("E", bound=BaseException)


def raises(error: type[E], what: str, call: Callable[[], object]) -> E:
    """The ``error`` that ``call()`` raises; fails the test, naming ``what``, where it does not."""
    try:
        call()
    except error as exc:
        return exc
    pytest.fail(f"{what}: expected {error.__name__}, but the call returned")


#: What a gated suite test needs the backend to declare, by name: any one of these capabilities.
REQUIREMENTS: dict[str, frozenset[Capability]] = {
    c.value: frozenset({c})
    for c in (
        Capability.TEXT,
        Capability.PROCESSED_LOGPROBS,
        Capability.STOP_STRINGS,
        Capability.PER_SAMPLE_SAMPLING,
        Capability.SLEEP_WAKE,
        Capability.REFIT_COLLECTIVE,
        Capability.ASYNC,
        Capability.DATA_PARALLEL,
        Capability.ADAPTERS,
    )
} | {"refit": frozenset({Capability.REFIT_TENSORS, Capability.REFIT_IPC})}

T = TypeVar("T")
#: A requirement's marker is this and its name.
MARKER_PREFIX = "requires_"


def requirement_marker(name: str) -> str:
    """The marker that shows requirement ``name`` at collection (``-m requires_async``)."""
    if name not in REQUIREMENTS:
        raise ValueError(f"no suite requirement {name!r}; known: {sorted(REQUIREMENTS)}")
    return MARKER_PREFIX + name


def requires(*names: str) -> Callable[[T], T]:
    """Mark a suite test as needing each requirement of ``names`` (``REQUIREMENTS``), as
    ``__requires__ = (...)`` on an area class marks all its tests (SQLAlchemy's way): the plugin
    gives each such test a ``requires_<name>`` marker at collection (``-m requires_async``). The
    test's body gates on each with ``skip_unless``."""
    for name in names:
        requirement_marker(name)

    def mark(test: T) -> T:
        test.__requires__ = (*getattr(test, "__requires__", ()), *names)  # type: ignore[attr-defined]
        return test

    return mark


def describe(name: str) -> str:
    """``name``, with its capabilities where it stands for several."""
    caps = sorted(c.value for c in REQUIREMENTS[name])
    return name if caps == [name] else f"{name} ({' or '.join(caps)})"


def skip_unless(caps: frozenset[Capability], name: str, call: Callable[[], object]) -> None:
    """The gate of requirement ``name`` (which the test is marked with, ``requires``): where
    ``caps`` meet it, return; else assert that ``call()`` raises UnsupportedCapability, then skip."""
    skip_unless_declared(bool(REQUIREMENTS[name] & caps), describe(name), call)


def skip_unless_declared(declared: bool, what: str, call: Callable[[], object]) -> None:
    """The capability gate of a test: where ``what`` is not declared, assert that ``call()``
    raises UnsupportedCapability, then skip; where it is declared, return."""
    if declared:
        return
    raises(UnsupportedCapability, f"{what} is not declared", call)
    pytest.skip(f"{what} not declared (UnsupportedCapability asserted)")


def rows_where(bad: torch.Tensor) -> list[int]:
    """Indices of the rows of a [B, ...] boolean tensor with any True."""
    return bad.reshape(bad.shape[0], -1).any(1).nonzero().flatten().tolist()


def fp32_bound() -> dict[str, float]:
    return BOUNDS["float32-cuda" if torch.cuda.is_available() else "float32"]


def can_refit(caps: frozenset[Capability]) -> bool:
    return bool(REQUIREMENTS["refit"] & caps)


def check_against_reference(
    reference: Any, out: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor], dtype: str
) -> dict[str, float]:
    """Greedy tokens are the reference's argmax; logprobs agree within BOUNDS[dtype]."""
    ids, lengths, ends = out["output_ids"], batch["input_lengths"], out["unpadded_sequence_lengths"]
    mask = generated_mask(out, lengths)
    logp = next_token_logprobs(reference, ids, ends)  # one reference pass for logprobs and argmax
    ref = scored_logprobs(logp, ids, lengths, ends)
    stats = agreement(out["logprobs"], ref, mask)
    best = torch.zeros_like(ids)
    best[:, 1:] = logp.argmax(-1)
    top = torch.zeros_like(out["logprobs"])
    top[:, 1:] = logp.max(-1).values
    mismatch = mask & (best != ids)
    stats["argmax_mismatches"] = int(mismatch.sum())
    if dtype == "float32":
        assert stats["argmax_mismatches"] == 0, (
            f"{stats['argmax_mismatches']} greedy tokens differ from the reference argmax, at "
            f"(row, position) {mismatch.nonzero().tolist()}"
        )
    else:
        gap = (top - ref)[mismatch]
        assert (gap < BF16_TIE_GAP).all(), (
            f"greedy tokens differ from the reference argmax by more than a near-tie: logprob gaps "
            f"{gap.tolist()} (a tie is below {BF16_TIE_GAP})"
        )
    bound = fp32_bound() if dtype == "float32" else BOUNDS[dtype]
    for key in ("max_abs", "token_mult_prob_error"):
        assert stats[key] <= bound[key], (
            f"{dtype} logprobs against the reference: {key} {stats[key]:.4g} above the bound "
            f"{bound[key]} (all measures: {stats})"
        )
    return stats


def device_memory_used() -> int:
    if not torch.cuda.is_available():
        return 0
    free, total = torch.cuda.mem_get_info()
    return total - free


def assert_same_tokens(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal token tensors; else the test fails, naming ``label``, the shapes and the rows."""
    rows = [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
    assert got.shape == want.shape and not rows, (
        f"{label}: shapes {tuple(got.shape)} and {tuple(want.shape)}, rows that differ {rows}:\n"
        f"{got.tolist()}\nvs\n{want.tolist()}"
    )


def assert_same_generation(
    request: pytest.FixtureRequest,
    label: str,
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
) -> None:
    """Same tokens, and logprobs within ``REPEAT_MAX_ABS``; records the largest difference."""
    atol = REPEAT_MAX_ABS["cuda" if torch.cuda.is_available() else "cpu"]
    assert_same_tokens(f"{label}: greedy tokens", got["output_ids"], want["output_ids"])
    diff = (got["logprobs"] - want["logprobs"]).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    request.node.user_properties.append((f"{label}_max_abs_logprob_diff", worst))
    assert worst <= atol, (
        f"{label}: same tokens, but logprobs differ by up to {worst:.3g} (> {atol}); "
        f"per row: {diff.amax(dim=1).tolist()}"
    )
