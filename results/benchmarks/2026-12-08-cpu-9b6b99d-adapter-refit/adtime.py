"""An adapter refit's whole time on vLLM-CPU (tiny model, fp32, every projection adapted), no
timing wrappers: per rank, 60 refits cycling through 4 seeded adapters, median of the last 50."""
import statistics, time, sys, json, rollgen
from rollgen.testing import tiny_config
from rollgen.testing.reference import random_adapter
from rollgen.refit.adapters import AdapterSpec
rows = []
for rank in map(int, sys.argv[1:]):
    cfg = tiny_config("vllm", lora={"rank": rank, "max_versions": 2}, max_new_tokens=4, dtype="float32")
    with rollgen.create_generation(cfg) as gen:
        spec = AdapterSpec.of(cfg["lora"], gen.weight_spec)
        ads = [random_adapter(spec, seed=s) for s in range(4)]
        times = []
        for i in range(60):
            t = time.perf_counter(); gen.refit(ads[i % 4], target="adapter"); times.append(time.perf_counter() - t)
    rows.append({"rank": rank, "tensors": len(ads[0]), "median_ms": 1e3 * statistics.median(times[10:]), "min_ms": 1e3 * min(times[10:])})
print("RESULT", json.dumps(rows))
