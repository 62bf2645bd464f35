"""The example engine: greedy or sampled decoding by recomputing the full sequence each step (the
engine of docs/writing-a-backend.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from rollgen import BaseGeneration, BatchedDataDict
from rollgen.output import assemble_from_lists
from rollgen.refit import EngineFacts, InProcessLink, load_into_module
from rollgen.sampling import SampleParams, process_logits


class ExampleGeneration(BaseGeneration):
    def __init__(self, config: Mapping[str, Any], cluster: Any = None, backend: Any = None) -> None:
        super().__init__(config, cluster=cluster, backend=backend)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.cfg["model_name"], dtype=self.engine_dtype
        ).eval()
        # refits: the tensors themselves, handed to _load_weights (no prefix cache to reset)
        self.link_engine(InProcessLink(EngineFacts(transport="tensors"), self._load_weights))

    @torch.no_grad()
    def _generate(self, batch: BatchedDataDict[Any], params: list[SampleParams]) -> BatchedDataDict[Any]:
        rows, logprobs = [], []
        for ids, n, p in zip(batch["input_ids"], batch["input_lengths"].tolist(), params):
            seq: list[int] = ids[:n].tolist()
            tokens: list[int] = []
            lps: list[float] = []
            # each sample's seed alone drives it: the same sample in another batch or shard
            rng = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
            for _ in range(p.max_new_tokens):
                logits = self.model(input_ids=torch.tensor([seq + tokens])).logits[0, -1].float()
                if p.greedy:
                    token = int(logits.argmax())
                else:  # temperature, then top-k, then top-p (rollgen.sampling.process_logits)
                    settings = (torch.tensor([x]) for x in (p.temperature, p.top_k, p.top_p))
                    probs = process_logits(logits[None], *settings)[0].softmax(-1)
                    token = int(torch.multinomial(probs, 1, generator=rng))
                tokens.append(token)
                lps.append(float(logits.log_softmax(-1)[token]))  # raw: temperature 1
                if token in p.stop_token_ids:  # the config's stop ids and the model's EOS ids
                    break
            rows.append(tokens)
            logprobs.append(lps)
        return assemble_from_lists(
            batch["input_ids"], batch["input_lengths"], rows, logprobs, self.cfg["pad_token_id"]
        )

    def _load_weights(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        load_into_module(self.model, named)
