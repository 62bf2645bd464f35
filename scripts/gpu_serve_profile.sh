#!/usr/bin/env bash
# benchmarks.serve_gpu with py-spy (--gil: only the threads holding their process's GIL) on each
# of rollgen's processes (the trainer's, the HTTP side's, the engine actor's, the engine core's)
# during the first level's "rollgen serve" load and then its "in-process submit" load:
#   bash scripts/gpu_serve_profile.sh OUT PY_SPY SECONDS -- SERVE_GPU_ARGS...
# (run through scripts/gpu_run.sh). Writes OUT/serve_gpu.log, the benchmark's JSON in OUT, and
# OUT/profile-{serve,submit}-{trainer,front,actor,core}.txt (py-spy's raw format: one stack and
# its sample count a line; scripts/profile_summary.py sums them up).
set -uo pipefail
out=$1 spy=$2 seconds=$3
shift 4
mkdir -p "$out"
python3 -m benchmarks.serve_gpu "$@" --out "$out" > "$out/serve_gpu.log" 2>&1 &
bench=$!
wait_for() {  # a line matching $1 in the log, or the benchmark's end
  until grep -q "$1" "$out/serve_gpu.log"; do
    kill -0 $bench 2>/dev/null || return 1
    sleep 0.5
  done
}
record() {  # $1: the phase's name
  local roles=(trainer front actor core)
  local pids=($bench $(pgrep -f -- '-m rollgen.serving' | head -1) $(pgrep -f '^ray::VllmWorker' | head -1) \
    $(pgrep -f '^VLLM::EngineCore' | head -1))
  for i in 0 1 2 3; do
    [ -n "${pids[$i]:-}" ] && "$spy" record --gil -r 100 -d "$seconds" -f raw \
      -o "$out/profile-$1-${roles[$i]}.txt" -p "${pids[$i]}" > "$out/py-spy-$1-${roles[$i]}.log" 2>&1 &
  done
  wait $(jobs -p | grep -v "^$bench$") 2>/dev/null
}
wait_for "rollgen serving" && sleep 4 && record serve
wait_for "^rollgen serve  *[0-9]" && sleep 1 && record submit  # the first level's serve row
wait $bench
