"""Worker extension loaded into every vLLM worker (``worker_extension_cls``)."""

from __future__ import annotations

import pickle

import torch


class RollgenWorkerExtension:
    """Methods reached through ``LLM.collective_rpc``; ``self`` is a vLLM worker."""

    def rollgen_device_uuid(self) -> str:
        from rollgen.refit import device_uuid

        return device_uuid(self.device) if torch.cuda.is_available() else "cpu"

    def rollgen_load_bucket(self, per_rank: list[bytes]) -> int:
        """Load one pickled WeightBucket of HF-named full tensors (``per_rank[rank]``); each
        rank keeps its own shard."""
        bucket = pickle.loads(per_rank[getattr(self, "rank", 0)])
        named = bucket.unpack(self.device if torch.cuda.is_available() else None)
        if hasattr(self, "reload_weights"):
            # In-place layerwise reload: re-runs the kernel repacking (needed on CPU, where
            # linear weights are prepacked and plain load_weights fails).
            self.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
        else:
            self.model_runner.model.load_weights(weights=named)
        return len(named)
