"""``HfGeneration``: the contract on a transformers causal LM, in process."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from rollgen.base import BaseGeneration
from rollgen.data import BatchedDataDict, right_pad
from rollgen.errors import ConfigError
from rollgen.output import assemble_output
from rollgen.refit import EngineFacts, InProcessLink, Named, WeightSpec, device_uuid, load_into_module
from rollgen.rollout import SampleRequest
from rollgen.sampling import SampleParams
from rollgen.streaming_loop import StepLoop
from rollgen_hf.adapters import LoraLayers, serving
from rollgen_hf.decode import Cohorts, Decoder
from rollgen_hf.model import load_model, offload, release_memory

logger = logging.getLogger(__name__)


class HfGeneration(BaseGeneration):
    """Runs the model with transformers on one device. Logprobs are raw (log-softmax of the
    unprocessed logits) unless ``logprobs_mode="processed"``."""

    #: The batched decoder each generate and each submitted request list runs in.
    decoder_cls: ClassVar[type[Decoder]] = Decoder
    #: The adapter versions' holder (with the config's ``lora``).
    adapters_cls: ClassVar[type[LoraLayers]] = LoraLayers

    def __init__(self, config: Mapping[str, Any], cluster: Any = None, backend: Any = None) -> None:
        super().__init__(config, cluster=cluster, backend=backend)
        hf_cfg = self.cfg["hf_cfg"]
        device = hf_cfg["device"]
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.device = torch.device(device)
        except RuntimeError as exc:
            raise ConfigError(f"hf_cfg.device {device!r} is not a torch device: {exc}") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"hf_cfg.device {device!r}: CUDA is not available here; use 'cpu' or 'auto'")
        self.model = load_model(
            self.cfg["model_name"],
            self.engine_dtype,
            self.device,
            hf_cfg["attn_implementation"],
            self.cfg["hf_kwargs"],
        )
        # draws for samples without a seed (with a config seed, the core seeds every sample)
        self._generator = torch.Generator()
        self._generator.seed()
        # streamed samples: one thread decodes every submitted batch, a step of each in turn
        # (``deliver`` looked up at each report: a subclass may wrap it)
        cohorts = Cohorts(self._cohort)
        self._decoding = StepLoop(
            cohorts.add,
            cohorts.step,
            cohorts.abort,
            lambda ended: self._streams.deliver(ended),
            "rollgen-hf",
            lambda moved: self._streams.progress(moved),
        )
        facts = EngineFacts(
            transport="tensors",
            devices=(device_uuid(self.device),) if self.device.type == "cuda" else (),
            sync_device=self.device,
        )
        #: The adapter versions the model holds (with the config's ``lora``).
        self.adapters = self.adapters_cls.of(self.model, self.cfg.get("lora"))
        link = InProcessLink(
            facts,
            self._load_weights,
            load_adapter=self.adapters and self._load_adapter,
            drop_adapter=self.adapters and self._drop_adapter,
        )
        self.link_engine(link, weights=self._weights)

    def _load_adapter(self, version: int, named: Named) -> None:
        """Between two steps of the streamed samples (a ``keep`` update leaves them running)."""
        adapters = self.adapters
        if adapters is not None:
            self._decoding.call(lambda: adapters.load(version, named))

    def _drop_adapter(self, version: int) -> None:
        adapters = self.adapters
        if adapters is not None:
            self._decoding.call(lambda: adapters.drop(version))

    def _weights(self) -> WeightSpec:
        return WeightSpec.of_module(self.model)

    @property
    def releases_memory_on_sleep(self) -> bool:
        return self.device.type == "cuda"

    def _generate(self, batch: BatchedDataDict[Any], params: list[SampleParams]) -> BatchedDataDict[Any]:
        decoded = self._decoder(batch["input_ids"], batch["input_lengths"], params).run()
        return assemble_output(
            batch["input_ids"],
            batch["input_lengths"],
            decoded.tokens,
            decoded.logprobs,
            decoded.lengths,
            self.cfg["pad_token_id"],
        )

    def _stop_hit(self, params: list[SampleParams]) -> Any:
        return lambda row, tokens: self._hits_stop_string(params[row], tokens)

    def _stream_start(self, requests: list[SampleRequest]) -> None:
        self._decoding.start(requests)

    def _stream_abort(self, keys: list[str]) -> None:
        self._decoding.abort(keys)

    def _decoder(
        self, input_ids: torch.Tensor, input_lengths: torch.Tensor, params: list[SampleParams]
    ) -> Decoder:
        return self.decoder_cls(
            serving(self.model, self.adapters, params),
            input_ids,
            input_lengths,
            params,
            pad_token_id=self.cfg["pad_token_id"],
            processed_logprobs=self.cfg["logprobs_mode"] == "processed",
            stop_hit=self._stop_hit(params),
            generator=self._generator,
        )

    def _cohort(self, requests: list[SampleRequest]) -> Decoder:
        ids, lengths = right_pad([r.prompt_ids for r in requests], self.cfg["pad_token_id"], torch.long)
        return self._decoder(ids, lengths, [r.params for r in requests])

    def _load_weights(self, named: Named) -> None:
        """Copy a validated update's tensors into the model (every decode prefills afresh: no
        prefix cache to reset)."""
        load_into_module(self.model, named)

    def _sleep(self) -> None:
        if self.device.type == "cuda":
            offload(self.model)

    def _wake(self, tags: list[str]) -> None:
        if self.device.type == "cuda" and "weights" in tags:
            self.model.to(self.device)

    def _shutdown(self) -> None:
        self._decoding.stop()
        del self.model
        release_memory(self.device)
