"""Vectorised output assembly equals the straightforward per-sample loop."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollgen.data import right_pad
from rollgen.output import assemble_output


def loop_reference(ids, lengths, gens, lps, pad):
    width = ids.shape[1] + max((len(g) for g in gens), default=0)
    out = torch.full((len(gens), width), pad, dtype=torch.long)
    lp = torch.zeros((len(gens), width))
    for i, (g, lp_row) in enumerate(zip(gens, lps)):
        n = int(lengths[i])
        out[i, :n] = ids[i, :n]
        for j, (t, v) in enumerate(zip(g, lp_row)):
            out[i, n + j] = t
            lp[i, n + j] = v
    return out, lp


@settings(max_examples=80)
@given(data=st.data())
def test_assembly_matches_loop(data) -> None:
    batch = data.draw(st.integers(1, 6))
    width = data.draw(st.integers(1, 7))
    lengths = torch.tensor([data.draw(st.integers(1, width)) for _ in range(batch)])
    pad = 99
    ids = torch.full((batch, width), pad)
    for i, n in enumerate(lengths.tolist()):
        ids[i, :n] = torch.randint(0, 50, (n,))
    gens = [data.draw(st.lists(st.integers(0, 50), min_size=0, max_size=6)) for _ in range(batch)]
    lps = [[-0.5 * (j + 1) for j in range(len(g))] for g in gens]
    gen_ids, gen_len = right_pad(gens, 0, torch.long)
    gen_lp, _ = right_pad(lps, 0.0, torch.float32)
    out = assemble_output(ids, lengths, gen_ids, gen_lp, gen_len, pad)
    ref_ids, ref_lp = loop_reference(ids, lengths, gens, lps, pad)
    assert torch.equal(out["output_ids"], ref_ids)
    assert torch.equal(out["logprobs"], ref_lp)
    assert torch.equal(out["unpadded_sequence_lengths"], lengths + gen_len)


def test_a_backends_output_is_checked_against_the_contract() -> None:
    import pytest

    from rollgen.errors import OutputError
    from rollgen.output import assemble_from_lists, check_output

    ids, lengths = torch.tensor([[1, 2, 0], [3, 4, 5]]), torch.tensor([2, 3])
    good = assemble_from_lists(ids, lengths, [[7], [8, 9]], [[-0.5], [-0.1, -0.2]], 0)
    check_output(good, ids, lengths)
    cases = {
        "float64": ({**good, "logprobs": good["logprobs"].double()}, "'logprobs': expected a torch.float32"),
        "width": ({**good, "logprobs": good["logprobs"][:, :-1]}, r"'logprobs': expected shape \[2, 5\]"),
        "missing": ({k: v for k, v in good.items() if k != "output_ids"}, "lacks \\['output_ids'\\]"),
        "lengths": (
            {**good, "unpadded_sequence_lengths": good["unpadded_sequence_lengths"] + 1},
            "expected input_lengths \\+ generation_lengths",
        ),
    }
    for out, message in cases.values():
        with pytest.raises(OutputError, match=message):
            check_output(out, ids, lengths)


def test_stop_reasons_are_read_off_each_samples_end() -> None:
    from rollgen.output import assemble_from_lists, stop_reasons
    from rollgen.sampling import SampleParams

    def params(budget: int, stops: tuple[str, ...] = ()) -> SampleParams:
        return SampleParams(1.0, 1.0, -1, budget, stops, (2, 9), None)

    ids, lengths = torch.tensor([[5, 5, 5]] * 3 + [[5, 5, 0]] + [[5, 5, 5]]), torch.tensor([3, 3, 3, 2, 3])
    tokens = [[7, 2], [7, 9], [7, 8], [7, 7], [7, 7]]  # EOS 2; stop id 9; a stop string; budget; context
    out = assemble_from_lists(ids, lengths, tokens, [[-1.0] * len(t) for t in tokens], 0)
    got = stop_reasons(
        out,
        lengths,
        [params(2), params(2), params(2, ("xy",)), params(2), params(2)],
        eos_token_ids=[2],
        max_model_len=5,
        hit_stop_string=lambda i, toks: toks == [7, 8],
    )
    assert got == ["eos", "stop_token", "stop_string", "length", "context"]
