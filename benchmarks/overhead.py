"""rollgen's own work per generate call, without an engine: input validation, per-sample
settings, data-parallel sharding, output assembly from the engine's per-sample token and logprob
lists, the merge and the core's check of the result (contract, stop reasons, finite logprobs),
against a straightforward per-sample, per-token loop like the seed's (assembly only).

    python -m benchmarks.overhead [--repeats 5] [--dp 2]
"""

from __future__ import annotations

import argparse
import random
from functools import partial
from typing import Any

import torch

from benchmarks.common import alternate, print_table, write_results
from rollgen.config import validate_config
from rollgen.data import BatchedDataDict
from rollgen.distributed.worker import GenerateRequest
from rollgen.output import assemble_from_lists, finish_output
from rollgen.sampling import resolve_sampling
from rollgen.spec import GenerationConfig
from rollgen.validation import validate_generation_input

PAD = 0
#: A config with every default (what the core resolves per-sample settings from).
CONFIG = validate_config(
    {"backend": "none", "model_name": "none", "max_new_tokens": 4096, "pad_token_id": PAD}, GenerationConfig
)
SHAPES = [(8, 128, 128), (256, 128, 256), (256, 1024, 1024), (1024, 2048, 2048)]


def make_call(batch: int, prompt: int, gen: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], list, list]:
    """A right-padded batch and what an engine returns for it (token and logprob lists)."""
    rng = random.Random(seed)
    lengths = torch.tensor([rng.randint(prompt // 2, prompt) for _ in range(batch)])
    ids = torch.randint(1, 30000, (batch, prompt))
    ids[torch.arange(prompt).unsqueeze(0) >= lengths.unsqueeze(1)] = PAD
    gen_lens = [rng.randint(gen // 2, gen) for _ in range(batch)]
    tokens = [torch.randint(1, 30000, (n,)).tolist() for n in gen_lens]
    logprobs = [(-torch.rand(n)).tolist() for n in gen_lens]
    return {"input_ids": ids, "input_lengths": lengths}, tokens, logprobs


def rollgen_call(data: dict[str, torch.Tensor], tokens: list, logprobs: list, dp: int) -> Any:
    batch = validate_generation_input(data, pad_token_id=PAD, vocab_size=32000, max_model_len=16384)
    params = resolve_sampling(CONFIG, batch, greedy=False, max_model_len=16384)
    outs, start = [], 0
    for request in GenerateRequest.shards(batch, params, dp):  # each data-parallel leader's work
        n = len(request)
        outs.append(
            assemble_from_lists(
                request.input_ids,
                request.input_lengths,
                tokens[start : start + n],
                logprobs[start : start + n],
                PAD,
            )
        )
        start += n
    out = BatchedDataDict.from_batches(outs, pad_value_dict={"output_ids": PAD})
    finish_output(out, batch, params, (PAD,), 16384, lambda i, tokens: False)
    return out


def seed_style_call(data: dict[str, torch.Tensor], tokens: list, logprobs: list) -> Any:
    """The straightforward way: one row at a time, one Python step per generated token."""
    ids, lengths = data["input_ids"], data["input_lengths"]
    width = ids.shape[1] + max(len(t) for t in tokens)
    rows, lp_rows = [], []
    for i, (gen, lps) in enumerate(zip(tokens, logprobs)):
        n = int(lengths[i])
        row = torch.full((width,), PAD, dtype=torch.long)
        row[:n] = ids[i, :n]
        row[n : n + len(gen)] = torch.tensor(gen)
        lp = torch.zeros(width)
        for j, value in enumerate(lps):
            lp[n + j] = value
        rows.append(row)
        lp_rows.append(lp)
    return torch.stack(rows), torch.stack(lp_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dp", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for batch, prompt, gen in SHAPES:
        data, tokens, logprobs = make_call(batch, prompt, gen)
        ours, theirs = rollgen_call(data, tokens, logprobs, args.dp), seed_style_call(data, tokens, logprobs)
        if not (torch.equal(ours["output_ids"], theirs[0]) and torch.equal(ours["logprobs"], theirs[1])):
            raise SystemExit(f"outputs differ at {batch}x{prompt}+{gen}")
        t = alternate(
            {
                "rollgen": partial(rollgen_call, data, tokens, logprobs, args.dp),
                "seed_loop": partial(seed_style_call, data, tokens, logprobs),
            },
            repeats=args.repeats,
        )
        gen_tokens = sum(len(x) for x in tokens)
        rows.append(
            {
                "batch": batch,
                "prompt": prompt,
                "max_gen": gen,
                "gen_tokens": gen_tokens,
                "rollgen_ms": t["rollgen"]["median_s"] * 1e3,
                "rollgen_min_ms": t["rollgen"]["min_s"] * 1e3,
                "rollgen_max_ms": t["rollgen"]["max_s"] * 1e3,
                "seed_loop_ms": t["seed_loop"]["median_s"] * 1e3,
                "speedup": t["seed_loop"]["median_s"] / t["rollgen"]["median_s"],
                "rollgen_ns_per_token": t["rollgen"]["median_s"] / gen_tokens * 1e9,
            }
        )
    path = write_results("overhead", rows)
    print_table(
        rows,
        [
            "batch",
            "prompt",
            "max_gen",
            "gen_tokens",
            "rollgen_ms",
            "seed_loop_ms",
            "speedup",
            "rollgen_ns_per_token",
        ],
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
