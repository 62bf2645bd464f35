#!/usr/bin/env bash
# One conformance-suite run on the lent GPU machine (docs/gpu-results.md has the calls):
#   bash scripts/gpu_conformance.sh NAME SET BACKEND CUDA_DEVICES TIMEOUT_S [CONFIG_JSON [PYTEST_ARGS...]]
# (CONFIG_JSON may be '' ; PYTEST_ARGS e.g. --rollgen-one-engine, -k EXPR)
# Writes $OUT/conformance-NAME.json (the suite's report) and $OUT/log-NAME.txt. Stopped by SIGINT
# at the time limit, so pytest still writes the report of what ran.
set -uo pipefail
name=$1 set_=$2 backend=$3 devices=$4 limit=$5 config=${6:-}
shift $(( $# < 6 ? $# : 6 ))
out=${OUT:-out}
mkdir -p "$out"
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=$devices timeout -s INT -k 30 "$limit" bash scripts/gpu_run.sh "$set_" \
  python3 -m pytest -p rollgen.conformance --pyargs rollgen.conformance.suite -p no:cacheprovider \
  -q -rA --durations=0 --rollgen-backend="$backend" --rollgen-report="$out/conformance-$name.json" \
  ${config:+--rollgen-config="$config"} "$@" > "$out/log-$name.txt" 2>&1
rc=$?
# the report is rewritten after every test, so it has the counts even when the run was killed
summary=$(python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); print(d["summary"], [t["test"] for t in d["tests"] if t["outcome"] == "failed"])' "$out/conformance-$name.json" 2>/dev/null)
echo "[$name] rc=$rc in $(( $(date +%s) - t0 )) s: ${summary:-no report written}"
