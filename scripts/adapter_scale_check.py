"""How far an engine's unmerged LoRA in a half dtype lands from the merged reference, per
adapter scale: ``python scripts/adapter_scale_check.py [--backend hf] [--dtype bfloat16] 0.3 0.03``.
Prints, for each scale and four seeded adapters, the suite's reference check (or its failure)
and whether the adapter changed the outputs; the model alone first."""

from __future__ import annotations

import argparse

import torch

import rollgen
from rollgen.conformance.adapters import LORA, same_generation
from rollgen.conformance.checks import check_against_reference
from rollgen.refit.adapters import AdapterSpec
from rollgen.testing import tiny_config
from rollgen.testing.prompts import PROMPTS, encode
from rollgen.testing.reference import load_reference_model, merged_reference, random_adapter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("scales", type=float, nargs="+")
    parser.add_argument("--backend", default="hf")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    cfg = tiny_config(args.backend, dtype=args.dtype, lora=LORA)
    with rollgen.create_generation(cfg) as gen:
        batch = encode(gen.tokenizer, PROMPTS)
        spec = AdapterSpec.of(LORA, gen.weight_spec)
        alone = gen.generate(batch, greedy=True)
        reference = load_reference_model(cfg["model_name"]).to(dtype)
        print("alone", check_against_reference(reference, alone, batch, args.dtype))
        for scale in args.scales:
            for seed in (1, 2, 3, 4):
                adapter = random_adapter(spec, seed=seed, scale=scale)
                gen.refit(adapter, target="adapter")
                out = gen.generate(batch, greedy=True)
                try:
                    merged = merged_reference(cfg["model_name"], adapter, spec, dtype)
                    verdict = check_against_reference(merged, out, batch, args.dtype)
                except AssertionError as exc:
                    verdict = f"FAILED: {str(exc)[:160]}"
                print(f"scale {scale} seed {seed}: {verdict}; changed: {not same_generation(out, alone)}")


if __name__ == "__main__":
    main()
