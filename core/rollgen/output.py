"""Vectorised output assembly: generated tokens and logprobs into the GenerationOutputSpec layout."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from rollgen.data import BatchedDataDict, right_pad
from rollgen.errors import OutputError
from rollgen.sampling import SampleParams

#: Every output key and its dtype.
OUTPUT_DTYPES = {
    "output_ids": torch.long,
    "logprobs": torch.float32,
    "generation_lengths": torch.long,
    "unpadded_sequence_lengths": torch.long,
}


def empty_output(width: int = 0) -> BatchedDataDict[Any]:
    """The correctly typed output of an empty batch."""
    return BatchedDataDict(
        {
            "output_ids": torch.zeros((0, width), dtype=torch.long),
            "logprobs": torch.zeros((0, width), dtype=torch.float32),
            "generation_lengths": torch.zeros(0, dtype=torch.long),
            "unpadded_sequence_lengths": torch.zeros(0, dtype=torch.long),
            "stop_reasons": [],
        }
    )


def assemble_output(
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    gen_ids: torch.Tensor,
    gen_logprobs: torch.Tensor,
    gen_lengths: torch.Tensor,
    pad_token_id: int,
) -> BatchedDataDict[Any]:
    """Place each sample's generation right after its unpadded prompt.

    ``gen_ids``/``gen_logprobs`` are [B, G'] (G' >= the longest generation); entries past
    ``gen_lengths`` are ignored. Output width is L + G with G = max(gen_lengths).
    """
    batch, width = input_ids.shape
    gen_width = int(gen_lengths.max()) if batch else 0
    total = width + gen_width
    output_ids = torch.full((batch, total), pad_token_id, dtype=torch.long)
    logprobs = torch.zeros((batch, total), dtype=torch.float32)
    output_ids[:, :width] = input_ids
    if gen_width:
        cols = torch.arange(gen_width).unsqueeze(0)
        valid = cols < gen_lengths.unsqueeze(1)
        rows = torch.arange(batch).unsqueeze(1).expand(-1, gen_width)
        dest = input_lengths.unsqueeze(1) + cols
        output_ids[rows[valid], dest[valid]] = gen_ids[:, :gen_width][valid].long()
        logprobs[rows[valid], dest[valid]] = gen_logprobs[:, :gen_width][valid].float()
    return BatchedDataDict(
        {
            "output_ids": output_ids,
            "logprobs": logprobs,
            "generation_lengths": gen_lengths.long(),
            "unpadded_sequence_lengths": input_lengths.long() + gen_lengths.long(),
        }
    )


def assemble_from_lists(
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    tokens: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]],
    pad_token_id: int,
) -> BatchedDataDict[Any]:
    """``assemble_output`` from per-sample token and logprob lists (as engines return them);
    a sample whose logprobs do not match its tokens raises instead of being padded over."""
    bad = [i for i, (t, lp) in enumerate(zip(tokens, logprobs, strict=True)) if len(t) != len(lp)]
    if bad:
        raise OutputError(f"the engine returned logprobs that do not match the tokens of samples {bad}")
    gen_ids, gen_lengths = right_pad(tokens, 0, torch.long)
    gen_lps, _ = right_pad(logprobs, 0.0, torch.float32)
    return assemble_output(input_ids, input_lengths, gen_ids, gen_lps, gen_lengths, pad_token_id)


def check_output(out: Mapping[str, Any], input_ids: torch.Tensor, input_lengths: torch.Tensor) -> None:
    """OutputError, naming the key, what was expected and what came, unless ``out`` (a backend's
    result for the batch ``input_ids``/``input_lengths``) meets the output contract's layout."""
    if not isinstance(out, Mapping):
        raise OutputError(f"the backend returned a {type(out).__name__}, not a dict of tensors")
    missing = [k for k in OUTPUT_DTYPES if k not in out]
    if missing:
        raise OutputError(f"the backend's output lacks {missing} (it has {sorted(out)})")
    for key, dtype in OUTPUT_DTYPES.items():
        value = out[key]
        if not isinstance(value, torch.Tensor) or value.dtype != dtype:
            got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise OutputError(f"output {key!r}: expected a {dtype} tensor, got {got}")
    batch, width = input_ids.shape
    gen = out["generation_lengths"]
    if gen.shape != (batch,):
        raise OutputError(f"output 'generation_lengths': expected shape [{batch}], got {list(gen.shape)}")
    expected = [batch, width + (int(gen.max()) if batch else 0)]
    for key in ("output_ids", "logprobs"):
        if list(out[key].shape) != expected:
            raise OutputError(
                f"output {key!r}: expected shape {expected} ([batch, input width + longest generation]), "
                f"got {list(out[key].shape)}"
            )
    if not torch.equal(out["unpadded_sequence_lengths"].cpu(), input_lengths.cpu() + gen.cpu()):
        raise OutputError(
            "output 'unpadded_sequence_lengths': expected input_lengths + generation_lengths "
            f"{(input_lengths.cpu() + gen.cpu()).tolist()}, got {out['unpadded_sequence_lengths'].tolist()}"
        )


def generated_mask(out: Mapping[str, torch.Tensor], input_lengths: torch.Tensor) -> torch.Tensor:
    """True at the generated positions of an output (``output_ids``' layout): where a trainer's
    loss and logprobs apply; False on the prompt and on padding."""
    positions = torch.arange(out["output_ids"].shape[1]).unsqueeze(0)
    return (positions >= input_lengths.unsqueeze(1)) & (
        positions < out["unpadded_sequence_lengths"].unsqueeze(1)
    )


#: Why a sample ended: the model's EOS (``ModelInfo.eos_token_ids``), a config ``stop_token_ids``,
#: a stop string, its ``max_new_tokens`` budget, or the model's context (``max_model_len``); a
#: streamed sample may also end ``aborted`` (by a weight update in ``abort`` mode, or shutdown) or
#: ``cancelled`` (``Rollout.cancel``).
STOP_REASONS = ("eos", "stop_token", "stop_string", "length", "context", "aborted", "cancelled")


def stop_reason(
    generated: Sequence[int],
    end: int,
    params: SampleParams,
    eos_token_ids: Sequence[int],
    max_model_len: int,
    hit_stop_string: Callable[[list[int]], bool],
) -> str:
    """Why a sample that ran to its end stopped, read off its ``generated`` tokens (``end``:
    prompt plus generation): its last token (an EOS id, else a stop id), else a stop string its
    text holds, else the end of its budget, which the model's context may have shortened."""
    last = generated[-1] if generated else None
    if last in eos_token_ids:
        return "eos"
    if last in params.stop_token_ids:
        return "stop_token"
    if params.stop_strings and hit_stop_string(list(generated)):
        return "stop_string"
    if end >= max_model_len or len(generated) < params.max_new_tokens:
        return "context"
    return "length"


def stop_reasons(
    out: Mapping[str, torch.Tensor],
    input_lengths: torch.Tensor,
    params: Sequence[SampleParams],
    eos_token_ids: Sequence[int],
    max_model_len: int,
    hit_stop_string: Callable[[int, list[int]], bool],
) -> list[str]:
    """Each sample's ``stop_reason`` in an output. ``hit_stop_string(i, tokens)`` decodes sample i."""
    ends, lengths = out["unpadded_sequence_lengths"].tolist(), out["generation_lengths"].tolist()
    rows = out["output_ids"]
    return [
        stop_reason(
            rows[i, end - n : end].tolist(),
            end,
            p,
            eos_token_ids,
            max_model_len,
            lambda tokens, i=i: hit_stop_string(i, tokens),  # type: ignore[misc]
        )
        for i, (p, end, n) in enumerate(zip(params, ends, lengths))
    ]


def finish_output(
    out: BatchedDataDict[Any],
    batch: Mapping[str, Any],
    params: Sequence[SampleParams],
    eos_token_ids: Sequence[int],
    max_model_len: int,
    hit_stop_string: Callable[[int, list[int]], bool],
) -> bool:
    """What the core does with every backend's result: check it against the contract
    (``check_output``) and add each sample's stop reason. Returns whether every logprob is
    finite (non-finite ones point at non-finite weights)."""
    check_output(out, batch["input_ids"], batch["input_lengths"])
    out["stop_reasons"] = stop_reasons(
        out, batch["input_lengths"], params, eos_token_ids, max_model_len, hit_stop_string
    )
    return bool(torch.isfinite(out["logprobs"]).all())
