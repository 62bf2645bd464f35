"""The output contract: registration, layout, EOS, empty batch, padding, context, text path."""

from __future__ import annotations

from typing import Any

import torch

from rollgen.conformance.checks import requires, rows_where, skip_unless
from rollgen.registry import RegisteredBackend
from rollgen.spec import Capability
from rollgen.testing.prompts import PROMPTS, encode, generated_texts


class OutputContractTests:
    """What every output looks like; all on the shared engine."""

    def test_registration(self, backend: RegisteredBackend) -> None:
        b = backend.backend
        caps = sorted(str(c) for c in b.capabilities)
        assert all(isinstance(c, Capability) for c in b.capabilities), (
            f"capabilities {caps} are not all rollgen.Capability members"
        )
        assert Capability.LOGPROBS in b.capabilities, (
            f"every backend must return logprobs: {b.name!r} declares {caps}"
        )
        assert backend.plugin.status == "ok", (
            f"plugin {backend.plugin.name!r} has status {backend.plugin.status!r}, expected 'ok'"
        )

    def test_output_layout(
        self, greedy_out: dict[str, torch.Tensor], batch: dict[str, torch.Tensor], base_config: dict[str, Any]
    ) -> None:
        out, pad = greedy_out, base_config["pad_token_id"]
        ids, lengths = batch["input_ids"], batch["input_lengths"]
        missing = {
            "output_ids",
            "logprobs",
            "generation_lengths",
            "unpadded_sequence_lengths",
            "stop_reasons",
        } - set(out)
        assert not missing, f"output keys {sorted(out)} lack {sorted(missing)}"
        dtypes = {k: out[k].dtype for k in ("output_ids", "logprobs", "generation_lengths")}
        dtypes["unpadded_sequence_lengths"] = out["unpadded_sequence_lengths"].dtype
        expected = dict.fromkeys(dtypes, torch.long) | {"logprobs": torch.float32}
        assert dtypes == expected, f"output dtypes {dtypes}, expected {expected}"
        gen = out["generation_lengths"]
        width = ids.shape[1] + int(gen.max())
        shapes = (tuple(out["output_ids"].shape), tuple(out["logprobs"].shape))
        assert shapes == ((ids.shape[0], width),) * 2, (
            f"output_ids and logprobs shapes {shapes}, expected {(ids.shape[0], width)} (input width "
            f"{ids.shape[1]} + longest generation {int(gen.max())})"
        )
        assert torch.equal(out["unpadded_sequence_lengths"], lengths + gen), (
            f"unpadded_sequence_lengths {out['unpadded_sequence_lengths'].tolist()} are not input_lengths "
            f"{lengths.tolist()} + generation_lengths {gen.tolist()}"
        )
        limit = base_config["max_new_tokens"]
        assert ((gen >= 1) & (gen <= limit)).all(), (
            f"generation_lengths {gen.tolist()} outside [1, max_new_tokens={limit}]"
        )
        positions = torch.arange(width).unsqueeze(0)
        prompt = positions < lengths.unsqueeze(1)
        tail = positions >= out["unpadded_sequence_lengths"].unsqueeze(1)
        padded_input = torch.full((ids.shape[0], width), pad)
        padded_input[:, : ids.shape[1]] = ids
        changed = prompt & (out["output_ids"] != padded_input)
        assert not changed.any(), f"prompt tokens changed in rows {rows_where(changed)}"
        unpadded = tail & (out["output_ids"] != pad)
        assert not unpadded.any(), (
            f"positions after the sequence are not pad_token_id={pad} in rows {rows_where(unpadded)}"
        )
        nonzero = (prompt | tail) & (out["logprobs"] != 0)
        assert not nonzero.any(), (
            f"logprobs of prompt or padding positions are not 0 in rows {rows_where(nonzero)}"
        )
        generated = ~(prompt | tail)
        logp = out["logprobs"].masked_fill(~generated, 0.0)
        assert torch.isfinite(logp).all(), (
            f"generated logprobs not finite in rows {rows_where(~torch.isfinite(logp))}"
        )
        assert (logp <= 0).all(), (
            f"generated logprobs above 0 in rows {rows_where(logp > 0)}: max {logp.max()}"
        )

    def test_eos_ends_generation(
        self,
        greedy_out: dict[str, torch.Tensor],
        batch: dict[str, torch.Tensor],
        tokenizer: Any,
        base_config: dict[str, Any],
    ) -> None:
        out, limit = greedy_out, base_config["max_new_tokens"]
        ended = out["generation_lengths"] < limit
        assert ended.any(), (
            f"no sample ended before max_new_tokens={limit} (generation_lengths "
            f"{out['generation_lengths'].tolist()}): the tiny model should end some lines with EOS"
        )
        last = out["output_ids"].gather(1, (out["unpadded_sequence_lengths"] - 1).unsqueeze(1)).squeeze(1)
        assert (last[ended] == tokenizer.eos_token_id).all(), (
            f"samples {ended.nonzero().flatten().tolist()} ended early with last tokens "
            f"{last[ended].tolist()}, expected EOS {tokenizer.eos_token_id}"
        )
        expected = ["eos" if e else "length" for e in ended.tolist()]
        assert out.get("stop_reasons") == expected, (
            f"stop_reasons {out.get('stop_reasons')}, expected {expected} (EOS, else the budget)"
        )

    def test_empty_batch(self, engine: Any) -> None:
        out = engine.generate(
            {
                "input_ids": torch.zeros((0, 4), dtype=torch.long),
                "input_lengths": torch.zeros(0, dtype=torch.long),
            }
        )
        got = {
            k: (tuple(out[k].shape), out[k].dtype) for k in ("output_ids", "logprobs", "generation_lengths")
        }
        assert got["output_ids"][0][0] == 0 and got["output_ids"][1] == torch.long, f"empty batch: {got}"
        assert got["logprobs"][0][0] == 0 and got["logprobs"][1] == torch.float32, f"empty batch: {got}"
        assert got["generation_lengths"][0] == (0,), f"empty batch: {got}"

    def test_single_sample_and_padding_width(
        self, engine: Any, tokenizer: Any, greedy_out: dict[str, torch.Tensor], base_config: dict[str, Any]
    ) -> None:
        """Extra right padding and batch composition do not change greedy tokens."""
        one = encode(tokenizer, PROMPTS[:1], extra_pad=5)
        out = engine.generate(one, greedy=True)
        n = int(out["unpadded_sequence_lengths"][0])
        alone, in_batch = out["output_ids"][0, :n], greedy_out["output_ids"][0, :n]
        assert torch.equal(alone, in_batch), (
            f"sample 0 alone with 5 extra pad columns: {alone.tolist()}; in the batch: {in_batch.tolist()}"
        )

    def test_context_limit(self, engine: Any, tokenizer: Any) -> None:
        limit = engine.max_model_len
        ids = torch.full((1, limit - 2), tokenizer.convert_tokens_to_ids("a"), dtype=torch.long)
        out = engine.generate({"input_ids": ids, "input_lengths": torch.tensor([limit - 2])}, greedy=True)
        n = int(out["unpadded_sequence_lengths"][0])
        assert n <= limit, f"a prompt of {limit - 2} tokens grew to {n}, past the context of {limit}"
        expected = ["context"] if n == limit else ["eos"]
        assert out["stop_reasons"] == expected, (
            f"stop_reasons {out['stop_reasons']} for a sample that ended at {n} of a context of {limit}, "
            f"expected {expected}"
        )

    @requires("text")
    def test_text_path(
        self,
        engine: Any,
        caps: frozenset[Capability],
        tokenizer: Any,
        batch: dict[str, torch.Tensor],
        greedy_out: dict[str, torch.Tensor],
    ) -> None:
        data = {"prompts": PROMPTS}
        skip_unless(caps, "text", lambda: engine.generate_text(data, greedy=True))
        texts = engine.generate_text(data, greedy=True)["texts"]
        expected = generated_texts(tokenizer, greedy_out, batch, skip_special=True)
        assert texts == expected, f"generate_text gave {texts!r}; generate, decoded, gave {expected!r}"
        empty = engine.generate_text({"prompts": []})["texts"]
        assert empty == [], f"generate_text of no prompts gave {empty!r}, expected []"
