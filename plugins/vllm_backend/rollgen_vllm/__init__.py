"""rollgen's vLLM backend (``"vllm"``): vLLM engines in Ray actors, TP tied groups, DP sharding."""
