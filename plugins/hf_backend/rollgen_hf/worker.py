"""``HfWorker``: the Ray actor that owns one transformers engine of the ``hf-ray`` backend (the
model in the actor's process, decoded by ``rollgen_hf.decode``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rollgen.data import right_pad
from rollgen.distributed.worker import EngineWorker
from rollgen.refit import Named, WeightBucket, WeightSpec, device_uuid, load_into_module
from rollgen.refit.transports.collective import SyncGroup, SyncGroupSpec, receive
from rollgen.rollout import SampleRequest
from rollgen.sampling import SampleParams
from rollgen.streaming_loop import StepOutput
from rollgen.text import hits_stop_string
from rollgen_hf.adapters import LoraLayers, serving
from rollgen_hf.decode import Cohorts, Decoder
from rollgen_hf.model import load_model, offload, release_memory


class HfWorker(EngineWorker):
    """One model on the actor's device (the GPU Ray gave it, or the CPU). Its death is its
    process's: there is no engine process of its own to watch."""

    def _start(self) -> None:
        from transformers import AutoTokenizer

        spec = self.spec
        self.device = torch.device("cuda", 0) if spec.use_gpus else torch.device("cpu")
        dtype = getattr(torch, spec.dtype)
        attn = spec.engine["attn_implementation"]
        self.model = load_model(spec.model_name, dtype, self.device, attn, spec.engine_kwargs)
        #: The adapter versions the model holds (with the config's ``lora``).
        self.adapters = LoraLayers.of(self.model, spec.lora)
        self.tokenizer = AutoTokenizer.from_pretrained(spec.model_name)
        # draws for samples without a seed (with a config seed, the core seeds every sample)
        self.generator = torch.Generator()
        self.generator.seed()
        self.cohorts = Cohorts(self._cohort)

    def _describe(self) -> dict[str, Any]:
        import transformers

        return {"transformers": transformers.__version__, "device": str(self.device)}

    def _decoder(self, prompts: list[list[int]], params: Sequence[SampleParams]) -> Decoder:
        ids, lengths = right_pad(prompts, self.spec.pad_token_id, torch.long)
        return Decoder(
            serving(self.model, self.adapters, params),
            ids,
            lengths,
            params,
            pad_token_id=self.spec.pad_token_id,
            processed_logprobs=self.spec.logprobs_mode == "processed",
            stop_hit=lambda row, tokens: hits_stop_string(self.tokenizer, params[row].stop_strings, tokens),
            generator=self.generator,
        )

    def _cohort(self, requests: list[SampleRequest]) -> Decoder:
        return self._decoder([r.prompt_ids for r in requests], [r.params for r in requests])

    def _generate(
        self, prompts: list[list[int]], params: Sequence[SampleParams]
    ) -> tuple[list[list[int]], list[list[float]]]:
        decoder = self._decoder(prompts, params)
        decoder.run()
        rows = [decoder.row(i) for i in range(len(prompts))]
        return [tokens for tokens, _ in rows], [logprobs for _, logprobs in rows]

    def _add_samples(self, requests: list[SampleRequest]) -> None:
        self.cohorts.add(requests)

    def _abort_samples(self, keys: list[str]) -> None:
        self.cohorts.abort(keys)

    def _step(self) -> list[StepOutput]:
        return self.cohorts.step()

    def _load_bucket(self, bucket: WeightBucket) -> None:
        load_into_module(self.model, bucket.unpack())

    def _load_adapter(self, version: int, named: Named) -> None:
        if self.adapters is not None:  # EngineWorker.load_adapter checked the config's lora
            self.adapters.load(version, named)

    def _drop_adapter(self, version: int) -> None:
        if self.adapters is not None:
            self.adapters.drop(version)

    def _devices(self) -> list[str]:
        return [device_uuid(self.device)] if self.device.type == "cuda" else []

    def _join_weight_sync(self, spec: SyncGroupSpec, first_rank: int) -> None:
        self.sync = SyncGroup(spec, first_rank, self.device)

    def _receive_weights(self, spec: WeightSpec) -> bool:
        return receive(self.sync, spec, lambda named: load_into_module(self.model, named))

    def _reset_prefix_cache(self) -> None:
        """Nothing to drop: every decode prefills its prompts afresh."""

    def _release_memory(self) -> None:
        offload(self.model)

    def _resume_memory(self, tags: list[str]) -> None:
        if "weights" in tags:
            self.model.to(self.device)

    def _stop(self) -> None:
        del self.model
        release_memory(self.device)
