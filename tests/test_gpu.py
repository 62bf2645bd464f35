"""GPU-only checks of the vLLM backend (run on the lent H200s; skipped elsewhere).
Results and the exact commands: docs/gpu-results.md."""

import importlib.util

import pytest
import torch

import rollgen
from rollgen.output import generated_mask
from rollgen.refit import GPU_BUCKET_BYTES, default_bucket_bytes
from rollgen.testing import load_reference_model, teacher_forced_logprobs
from rollgen.testing.prompts import PROMPTS, encode
from rollgen.testing.reference import agreement
from rollgen.testing.tiny_model import tiny_model_dir

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")


def config(hf_config: dict, **vllm_cfg) -> dict:
    return {
        **hf_config,
        "backend": "vllm",
        "dtype": "bfloat16",
        "max_new_tokens": 16,
        "vllm_cfg": {"gpu_memory_utilization": 0.2, **vllm_cfg},
    }


@pytest.fixture(scope="module")
def batch(model_dir: str) -> dict:
    from transformers import AutoTokenizer

    return encode(AutoTokenizer.from_pretrained(model_dir), PROMPTS * 4)


def used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


@pytest.mark.gpu
def test_cuda_ipc_refit_sleep_wake(hf_config: dict, batch: dict) -> None:
    with rollgen.create_generation(config(hf_config)) as gen:
        assert gen.local_transport == "cuda_ipc" and gen.releases_memory_on_sleep
        before = gen.generate(batch, greedy=True)
        awake = used()
        gen.finish_generation()
        asleep = used()
        assert awake - asleep > 1 << 30, f"sleep freed only {(awake - asleep) / 2**30:.2f} GiB"
        gen.prepare_for_generation(tags=["weights"])
        new = load_reference_model(tiny_model_dir(trained=False), torch.bfloat16).cuda()
        low, high = GPU_BUCKET_BYTES
        assert low <= default_bucket_bytes(new) <= high  # a GPU source: sized by its free memory
        gen.refit(new)  # CUDA IPC handles keyed by device UUID, from GPU tensors: zero-copy
        gen.prepare_for_generation(tags=["kv_cache"])
        assert used() - asleep > 1 << 30, "wake retakes the memory"
        after = gen.generate(batch, greedy=True)
        assert not torch.equal(before["output_ids"], after["output_ids"])
        lengths = batch["input_lengths"]
        ref = teacher_forced_logprobs(
            new.float().cpu(), after["output_ids"], lengths, after["unpadded_sequence_lengths"]
        )
        stats = agreement(after["logprobs"], ref, generated_mask(after, lengths))
        assert stats["token_mult_prob_error"] < 1.05, stats


@pytest.mark.gpu2
def test_tp2_and_dp2_match_tp1(hf_config: dict, batch: dict) -> None:
    with rollgen.create_generation(config(hf_config)) as tp1:
        base = tp1.generate(batch, greedy=True)
    for extra in ({"tensor_parallel_size": 2}, {"data_parallel_size": 2}):
        with rollgen.create_generation(config(hf_config, **extra)) as gen:
            out = gen.generate(batch, greedy=True)
            gen.refit(load_reference_model(tiny_model_dir(), torch.bfloat16))
        same = (out["output_ids"] == base["output_ids"]).all(dim=1).float().mean()
        assert same >= 0.9, (extra, float(same))  # bf16 TP reductions may flip a near-tie
