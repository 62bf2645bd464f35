"""The example engine: greedy or sampled decoding by recomputing the full sequence each step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from rollgen import BaseGeneration, BatchedDataDict, WeightBucket
from rollgen.output import assemble_from_lists
from rollgen.refit import load_into_module


class ExampleGeneration(BaseGeneration):
    local_transport = "tensors"

    def __init__(self, config: Mapping[str, Any], cluster: Any = None, backend: Any = None) -> None:
        super().__init__(config, cluster=cluster, backend=backend)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.cfg["model_name"], dtype=self.engine_dtype
        ).eval()
        self.rng = torch.Generator()
        if self.cfg["seed"] is not None:
            self.rng.manual_seed(self.cfg["seed"])

    @torch.no_grad()
    def _generate(self, batch: BatchedDataDict[Any], greedy: bool) -> BatchedDataDict[Any]:
        rows, lps = [], []
        # the core's stop ids: the config's and the model's EOS ids
        stops = [set(p.stop_token_ids) for p in self.sample_params(batch, greedy)]
        for ids, n, stop_ids in zip(batch["input_ids"], batch["input_lengths"].tolist(), stops):
            seq = ids[:n].tolist()
            budget = max(1, min(self.cfg["max_new_tokens"], self.max_model_len - n))
            gen, gen_lp = [], []
            for _ in range(budget):
                logits = self.model(input_ids=torch.tensor([seq + gen])).logits[0, -1].float()
                logp = logits.log_softmax(-1)
                if greedy or self.cfg["temperature"] == 0:
                    token = int(logits.argmax())
                else:
                    probs = (logits / self.cfg["temperature"]).softmax(-1)
                    token = int(torch.multinomial(probs, 1, generator=self.rng))
                gen.append(token)
                gen_lp.append(float(logp[token]))
                if token in stop_ids:
                    break
            rows.append(gen)
            lps.append(gen_lp)
        return assemble_from_lists(
            batch["input_ids"], batch["input_lengths"], rows, lps, self.cfg["pad_token_id"]
        )

    def _apply_bucket(self, bucket: WeightBucket) -> None:
        load_into_module(self.model, bucket.unpack())
