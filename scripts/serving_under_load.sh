#!/usr/bin/env bash
# The serving tests run again and again with two busy cores beside them (issue 43's determinism check):
#   bash scripts/serving_under_load.sh [RUNS=50] [PYTHON=.venv/bin/python]
# Prints a line a run (its exit status, seconds, pytest's summary); each run's output in out/under-load/.
set -uo pipefail
runs=${1:-50} python=${2:-.venv/bin/python}
mkdir -p out/under-load
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -c 'while True: pass' & b1=$!
python3 -c 'while True: pass' & b2=$!
trap 'kill $b1 $b2' EXIT
failed=0
for i in $(seq 1 "$runs"); do
  t0=$(date +%s)
  "$python" -m pytest tests/test_serving.py tests/test_serving_process.py tests/test_serving_refit.py \
    tests/test_serving_limits.py -q -p no:cacheprovider > "out/under-load/run-$i.txt" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
  echo "run $i rc=$rc $(( $(date +%s) - t0 ))s $(tail -1 "out/under-load/run-$i.txt")"
done
echo "$failed of $runs runs failed"
