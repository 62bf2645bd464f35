"""Input validation: every contract violation is found before any engine work and reported as an
``InputError`` that names the offending samples."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from functools import cache
from typing import Any, get_args

import torch
from pydantic import TypeAdapter, ValidationError

from rollgen.data import BatchedDataDict
from rollgen.errors import ConfigError, InputError
from rollgen.spec import PER_SAMPLE_SAMPLING_KEYS

#: Bounds of sampling settings tighter than the contract's that an engine enforces
#: (``{"temperature": (low, high)}``, None for no bound).
Limits = Mapping[str, tuple[float | None, float | None]]
_MAX_NAMED = 8
#: Every key a batch may hold.
BATCH_KEYS = ("input_ids", "input_lengths", "stop_strings", *PER_SAMPLE_SAMPLING_KEYS)


def _names(rows: torch.Tensor | list[int]) -> tuple[list[int], str]:
    idx = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
    shown = ", ".join(str(i) for i in idx[:_MAX_NAMED])
    if len(idx) > _MAX_NAMED:
        shown += f", ... ({len(idx)} in all)"
    return idx, shown


def _fail(rows: torch.Tensor | list[int], what: str) -> None:
    idx, shown = _names(rows)
    raise InputError(f"sample(s) {shown}: {what}", idx)


def validate_generation_input(
    data: Mapping[str, Any],
    *,
    pad_token_id: int,
    vocab_size: int,
    max_model_len: int,
) -> BatchedDataDict[Any]:
    """Check ``data`` against GenerationDatumSpec; return it as a BatchedDataDict."""
    if not isinstance(data, Mapping):
        raise InputError(f"generate() takes a dict of tensors, got {type(data).__name__}")
    _check_keys(data)
    missing = [k for k in ("input_ids", "input_lengths") if k not in data]
    if missing:
        raise InputError(f"batch is missing required key(s) {missing}")
    ids, lengths = data["input_ids"], data["input_lengths"]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise InputError("input_ids must be a 2-D LongTensor [batch, length] (right-padded)")
    if ids.dtype != torch.long:
        raise InputError(f"input_ids must have dtype torch.long, got {ids.dtype}")
    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1:
        raise InputError("input_lengths must be a 1-D LongTensor [batch]")
    if lengths.dtype != torch.long:
        raise InputError(f"input_lengths must have dtype torch.long, got {lengths.dtype}")
    batch, width = ids.shape
    if lengths.shape[0] != batch:
        raise InputError(f"input_lengths has {lengths.shape[0]} entries for a batch of {batch}")
    ids, lengths = ids.cpu(), lengths.cpu()

    bad = (lengths < 1) | (lengths > width)
    if bad.any():
        _fail(bad.nonzero().flatten(), f"input_lengths must be in [1, {width}] (the padded width)")
    too_long = lengths >= max_model_len
    if too_long.any():
        _fail(
            too_long.nonzero().flatten(),
            f"prompt is {int(lengths[too_long].max())} tokens; the model's context is "
            f"{max_model_len}, which leaves no room to generate. Shorten the prompt or raise "
            "max_model_len",
        )
    positions = torch.arange(width).unsqueeze(0)
    padding = positions >= lengths.unsqueeze(1)
    not_padded = ((ids != pad_token_id) & padding).any(dim=1)
    if not_padded.any():
        rows = not_padded.nonzero().flatten()
        left = (ids[rows, 0] == pad_token_id).any()
        hint = (
            "looks left-padded; rollgen takes right-padded input_ids"
            if left
            else "has non-pad tokens past input_lengths"
        )
        _fail(rows, f"{hint} (pad_token_id={pad_token_id})")
    out_of_vocab = ((ids < 0) | (ids >= vocab_size)) & ~padding
    if out_of_vocab.any():
        _fail(out_of_vocab.any(dim=1).nonzero().flatten(), f"token ids outside [0, {vocab_size})")

    checked: BatchedDataDict[Any] = BatchedDataDict(dict(data))
    checked["input_ids"], checked["input_lengths"] = ids, lengths
    _check_stop_strings(checked, batch)
    _check_per_sample(checked, batch)
    return checked


def _check_stop_strings(data: BatchedDataDict[Any], batch: int) -> None:
    stops = data.get("stop_strings")
    if stops is None:
        return
    if not isinstance(stops, list) or len(stops) != batch:
        raise InputError(f"stop_strings must be a list with one entry per sample ({batch})")
    bad = [
        i
        for i, s in enumerate(stops)
        if s is not None and not (isinstance(s, list) and all(isinstance(x, str) and x for x in s))
    ]
    if bad:
        _fail(bad, "stop_strings entry must be None or a list of non-empty strings")


def _check_keys(data: Mapping[str, Any]) -> None:
    unknown = sorted(set(data) - set(BATCH_KEYS))
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(str(key), BATCH_KEYS, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise InputError(f"unknown batch key(s) {', '.join(hints)}; a batch takes {list(BATCH_KEYS)}")


def _check_per_sample(data: BatchedDataDict[Any], batch: int) -> None:
    """Each per-sample setting: a number per sample, integers where the setting is one, within
    the bounds the config's type states (``rollgen.spec``)."""
    for key, bounds in PER_SAMPLE_SAMPLING_KEYS.items():
        if key not in data:
            continue
        try:
            value = torch.as_tensor(data[key])
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InputError(
                f"per-sample {key!r} must be a tensor of numbers of shape [{batch}]: {exc}"
            ) from None
        if value.shape != (batch,):
            raise InputError(f"per-sample {key!r} must have shape [{batch}], got {list(value.shape)}")
        integral = get_args(bounds)[0] is int
        if value.dtype == torch.bool or value.is_complex() or (integral and value.is_floating_point()):
            kind = "an integer" if integral else "a real number"
            raise InputError(f"per-sample {key!r} must hold {kind} per sample, got dtype {value.dtype}")
        try:
            _adapter(list[bounds]).validate_python(value.tolist())  # type: ignore[valid-type]
        except ValidationError as exc:
            errors = exc.errors()
            _fail([int(e["loc"][0]) for e in errors], f"per-sample {key}: {errors[0]['msg'].lower()}")
        data[key] = value


@cache
def _adapter(bounds: Any) -> TypeAdapter[Any]:
    return TypeAdapter(bounds)


def check_config_limits(limits: Limits, cfg: Mapping[str, Any], backend: str) -> None:
    """ConfigError listing every setting of ``cfg`` outside ``limits``, the ``backend``'s."""
    problems = [
        f"{key}: {cfg[key]} is outside {_bounds(lo, hi)}, which the {backend} engine takes"
        for key, (lo, hi) in limits.items()
        if cfg.get(key) is not None
        and not ((lo is None or cfg[key] >= lo) and (hi is None or cfg[key] <= hi))
    ]
    if problems:
        raise ConfigError(f"invalid config for backend {backend!r}", problems)


def check_batch_limits(limits: Limits, batch: Mapping[str, Any], backend: str) -> None:
    """InputError naming the samples whose per-sample settings are outside ``limits``."""
    for key, (lo, hi) in limits.items():
        if key in batch:
            values = torch.as_tensor(batch[key]).double()
            bad = (values < (-math.inf if lo is None else lo)) | (values > (math.inf if hi is None else hi))
            if bad.any():
                rows = bad.nonzero().flatten().tolist()
                raise InputError(
                    f"sample(s) {rows}: per-sample {key} outside {_bounds(lo, hi)}, which the {backend} "
                    "engine takes",
                    rows,
                )


def check_replica(replica: Any, replicas: int) -> None:
    """InputError unless ``replica`` (``submit``'s, where it names one) is one of ``replicas``."""
    if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < replicas:
        raise InputError(f"submit(replica={replica!r}): a replica is an int in [0, {replicas}) or None")


def _bounds(low: float | None, high: float | None) -> str:
    return f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"
