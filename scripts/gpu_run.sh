#!/usr/bin/env bash
# Runs a command on the lent GPU machine after ../shared/gpu staging (docs/gpu-results.md has the
# exact calls):  bash scripts/gpu_run.sh SET COMMAND...   with SET = vllm-ray or sglang.
# Installs rollgen and its backend distributions (plugins/*, each with its entry point) into
# /tmp/rg-HASH (HASH of the sources, so a changed tree gets its own copy and runs still going
# keep theirs), puts the staged wheel set on PYTHONPATH (for sglang: plus Ray alone, linked from
# the vllm-ray set, which must be staged too; the two sets are never mixed otherwise) and sets the
# environment the GPU notes prescribe.
set -uo pipefail
set_=${1:?usage: gpu_run.sh vllm-ray|sglang COMMAND...}
shift
site=/opt/gpu-site/$set_
[ -d "$site" ] || { echo "gpu_run: $site missing: stage the $set_ wheel set first"; exit 1; }
export PYTHONPATH=$site:$PWD/.gpu/bin PATH=$site/bin:$PATH
if [ "$set_" = sglang ]; then
  ray_only=/tmp/ray-only
  if [ ! -d $ray_only ]; then
    mkdir -p $ray_only
    for f in /opt/gpu-site/vllm-ray/{ray,ray-2.*,jsonschema,jsonschema-*,jsonschema_specifications*,referencing*,rpds*}; do
      [ -e "$f" ] && ln -s "$f" $ray_only/
    done
  fi
  export PYTHONPATH=$PYTHONPATH:$ray_only
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export RAY_AUTH_MODE=disabled VLLM_ALLREDUCE_USE_SYMM_MEM=0 NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2=0
export ROLLGEN_CACHE_DIR=/tmp/rgcache
rg=/tmp/rg-$(find pyproject.toml core plugins -type f \( -name '*.py' -o -name '*.toml' \) -print0 \
  | sort -z | xargs -0 cat | md5sum | cut -c1-10)
if [ ! -d "$rg/rollgen" ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "$rg.$$" . plugins/*_backend \
    || exit 1
  mv -T "$rg.$$" "$rg" 2>/dev/null || rm -rf "$rg.$$"  # a parallel run may have won
fi
# $PWD last: engine processes import the benchmarks' worker extension (benchmarks.vllm_ext)
export PYTHONPATH=$rg:$PYTHONPATH:$PWD
"$@"
