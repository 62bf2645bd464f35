#!/usr/bin/env bash
# Runs a command on the lent GPU machine, after ../shared/gpu staging of the vllm-ray wheel set
# (docs/gpu-results.md has the exact calls). Installs rollgen (with its entry points) into
# /tmp/rg, then runs "$@" with the environment the GPU notes prescribe.
set -uo pipefail
export PYTHONPATH=/opt/gpu-site/vllm-ray:$PWD/.gpu/bin PATH=/opt/gpu-site/vllm-ray/bin:$PATH
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export RAY_AUTH_MODE=disabled VLLM_ALLREDUCE_USE_SYMM_MEM=0 NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 ROLLGEN_CACHE_DIR=/tmp/rgcache
if [ ! -d /tmp/rg/rollgen ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/rg . || exit 1
fi
export PYTHONPATH=/tmp/rg:$PYTHONPATH
nvidia-smi -L
python3 -c "import vllm, torch, ray, transformers as t; print('vllm', vllm.__version__, 'torch', torch.__version__, 'ray', ray.__version__, 'transformers', t.__version__)"
"$@"
