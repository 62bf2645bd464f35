"""The weight-sync protocol on gloo, with the sender and the engine ranks as threads of this
process (each its own rank of one real process group): what arrives, what is refused before
any byte is applied, and a load that fails on one rank reaching every rank."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rollgen import auth
from rollgen.errors import RefitError
from rollgen.refit import WeightSpec
from rollgen.refit.transports.collective import SyncGroup, SyncGroupSpec, WeightSender, receive
from rollgen.testing.faults import Unreadable


def source() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(8, 8, generator=g),
        "model.norm.weight": torch.randn(8, generator=g),
        "lm_head.weight": torch.randn(16, 8, generator=g),
    }


def spec_of(state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> WeightSpec:
    return WeightSpec(
        {n: (tuple(t.shape), str(dtype or t.dtype).removeprefix("torch.")) for n, t in state.items()}
    )


def run_update(
    send: Callable[[WeightSender], None],
    spec: WeightSpec,
    engines: int = 2,
    fail_on: tuple[int, int] | None = None,
) -> tuple[BaseException | None, list[Any]]:
    """One update: ``send`` on rank 0 here, ``receive`` on ranks 1..engines in threads (rank
    ``fail_on[0]`` fails loading bucket ``fail_on[1]``). The sender's error, and each engine
    rank's result: (partial, loaded names) or its error."""
    sender = WeightSender(SyncGroupSpec("127.0.0.1", 0, 1 + engines, "gloo", timeout_s=60))
    results: list[Any] = [None] * engines

    def engine(rank: int) -> None:
        loaded: list[str] = []

        def load(named: list[tuple[str, torch.Tensor]]) -> None:
            if fail_on is not None and (rank, len(loaded)) == fail_on:
                raise RuntimeError("disk on fire")
            loaded.append([(n, t.clone()) for n, t in named])  # type: ignore[misc] # views of a reused buffer

        try:
            group = SyncGroup(sender.spec, rank)
            results[rank - 1] = (receive(group, spec, load), loaded)
        except Exception as exc:  # noqa: BLE001 - what each rank ended with, asserted by the tests
            results[rank - 1] = exc

    threads = [threading.Thread(target=engine, args=(r,)) for r in range(1, engines + 1)]
    for t in threads:
        t.start()
    error = None
    try:
        send(sender)
    except RefitError as exc:
        error = exc
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "an engine rank is still waiting"
    return error, results


def test_every_engine_rank_receives_every_tensor_exactly_in_bounded_buckets() -> None:
    state = source()
    error, results = run_update(lambda s: s.send(state, bucket_bytes=300), spec_of(state))
    assert error is None
    for partial, buckets in results:
        assert partial is False
        got = {n: t for bucket in buckets for n, t in bucket}
        assert list(got) == list(state) and all(torch.equal(got[n], state[n]) for n in state)
        assert len(buckets) == 3, "q/k of one attention block travel together; norm and head apart"


def test_a_cast_on_the_way_and_a_partial_update() -> None:
    state = source()
    norm = {"model.norm.weight": state["model.norm.weight"]}
    spec = spec_of(state, torch.bfloat16)
    error, results = run_update(lambda s: s.send(norm, dtype=torch.bfloat16, partial=True), spec)
    assert error is None
    for partial, buckets in results:
        ((name, tensor),) = buckets[0]
        assert partial and name == "model.norm.weight" and tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, state[name].to(torch.bfloat16))


def test_a_mismatch_is_refused_on_every_rank_before_any_byte_is_loaded() -> None:
    state = source()
    bad = {**state, "lm_head.weight": torch.zeros(3, 8)}
    error, results = run_update(lambda s: s.send(bad), spec_of(state))
    assert isinstance(error, RefitError) and "lm_head.weight: shape [3, 8]" in str(error)
    assert all(isinstance(r, RefitError) and not r.stale and r.problems == error.problems for r in results)


def test_nan_in_the_source_is_refused_by_the_sender_and_every_engine_rank() -> None:
    state = source()
    state["model.norm.weight"][2] = float("nan")
    error, results = run_update(lambda s: s.send(state), spec_of(state))
    assert isinstance(error, RefitError) and error.problems == ["model.norm.weight"]
    assert all(isinstance(r, RefitError) and r.problems == ["model.norm.weight"] for r in results)


def test_a_cast_that_overflows_is_refused() -> None:
    state = source()
    state["model.norm.weight"][0] = 1e6
    error, _ = run_update(lambda s: s.send(state, dtype=torch.float16), spec_of(state, torch.float16))
    assert isinstance(error, RefitError) and error.problems == ["model.norm.weight"]


def test_a_load_that_fails_on_one_rank_is_a_stale_refit_error_on_every_rank() -> None:
    state = source()
    error, results = run_update(lambda s: s.send(state, bucket_bytes=300), spec_of(state), fail_on=(2, 1))
    assert isinstance(error, RefitError) and error.stale
    assert "engine rank 2 failed to load bucket 2 of 3 (RuntimeError: disk on fire)" in str(error)
    assert all(isinstance(r, RefitError) and r.stale and str(r) == str(error) for r in results)


def test_a_source_the_sender_cannot_read_is_refused_on_every_rank() -> None:
    error, results = run_update(lambda s: s.send(None), spec_of(source()))  # type: ignore[arg-type]
    assert isinstance(error, RefitError) and "a refit source is a torch.nn.Module" in str(error)
    assert all(isinstance(r, RefitError) and str(r) == str(error) for r in results)


def test_a_bucket_the_sender_fails_to_pack_is_skipped_and_the_update_is_stale_everywhere() -> None:
    """The last bucket holds a tensor that fails to copy (a stand-in): the receivers load the
    buckets before it, skip it, and every rank raises a stale RefitError."""
    state = source()
    broken = {**state, "lm_head.weight": torch.zeros(16, 8).as_subclass(Unreadable)}
    error, results = run_update(
        lambda s: s.send(broken, bucket_bytes=300, check_finite=False), spec_of(state)
    )
    assert isinstance(error, RefitError) and error.stale and "failed to pack bucket 3 of 3" in str(error)
    for r in results:
        assert isinstance(r, RefitError) and r.stale and str(r) == str(error)


def test_a_bad_spec_is_a_refit_error() -> None:
    with pytest.raises(RefitError, match="use 'gloo'"):
        SyncGroupSpec("127.0.0.1", 1, 2, "mpi")  # type: ignore[arg-type]
    with pytest.raises(RefitError, match="at least one engine rank"):
        SyncGroupSpec("127.0.0.1", 1, 1)


def test_an_nccl_group_with_two_ranks_on_one_gpu_is_refused_before_anyone_joins(
    hf_config: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NCCL refuses (or hangs on) two ranks of one group on one GPU: two engines sharing a GPU
    is a RefitError naming it, before any rank joins (engine GPUs faked: this machine has none)."""
    import rollgen

    with rollgen.create_generation(hf_config) as gen:
        link = gen.updates.link
        monkeypatch.setattr(
            link,
            "facts",
            dataclasses.replace(link.facts, devices=("GPU-a", "GPU-a"), sync_device=torch.device("cuda", 0)),
        )
        spec = SyncGroupSpec("127.0.0.1", 29999, 2, "nccl", 5.0)
        with pytest.raises(RefitError, match=r"GPU\(s\) \['GPU-a'\]"):
            gen.init_weight_sync(spec)
        assert gen.weight_sync is None


# ---- who may join: the trust model of a group (the store, its secret, messages as data) -----------


@pytest.fixture
def cpu_config(hf_config: dict) -> dict:
    """The hf engine on the CPU (a gloo group), also on a machine with a GPU."""
    return {**hf_config, "hf_cfg": {"device": "cpu"}}


ROGUE = Path(__file__).with_name("rogue_rank.py")


@contextlib.contextmanager
def rogue_joined(spec: SyncGroupSpec, rank: int, marker: Path) -> Iterator[subprocess.Popen]:
    """A process without the secret (``rogue_rank.py``) that has started joining ``spec``'s
    group as ``rank`` before any member."""
    args = [spec.address, str(spec.port), str(spec.world_size), str(rank), str(marker)]
    proc = subprocess.Popen([sys.executable, str(ROGUE), *args])
    try:
        watch = dist.TCPStore(spec.address, spec.port, is_master=False, timeout=timedelta(seconds=60))
        watch.wait(["rogue-ready"])
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_rogue_that_joins_as_an_engine_rank_is_refused_and_nothing_it_sends_is_run(tmp_path: Path) -> None:
    sender = WeightSender(SyncGroupSpec("127.0.0.1", 0, 2, "gloo", timeout_s=20))
    marker = tmp_path / "payload-ran"
    with rogue_joined(sender.spec, 1, marker):
        with pytest.raises(RefitError, match=r"rank\(s\) \[1\] did not prove they hold the group's secret"):
            sender.connect()
    assert not marker.exists()


def test_a_rogue_in_the_senders_place_is_refused_by_the_engine_which_keeps_serving(
    cpu_config: dict, tmp_path: Path
) -> None:
    import rollgen

    marker = tmp_path / "payload-ran"
    with rollgen.create_generation(cpu_config) as gen:
        sender = WeightSender(gen.weight_sync_spec("127.0.0.1", timeout_s=20))
        with rogue_joined(sender.spec, 0, marker):
            with pytest.raises(
                RefitError, match=r"rank\(s\) \[0\] did not prove they hold the group's secret"
            ):
                gen.init_weight_sync(sender.spec)
        assert not marker.exists() and gen.weight_sync is None
        ids = torch.tensor([[5, 6, 7]])
        assert (
            gen.generate({"input_ids": ids, "input_lengths": torch.tensor([3])})["output_ids"].shape[0] == 1
        )


def test_the_store_listens_on_the_specs_address_only() -> None:
    sender = WeightSender(SyncGroupSpec("127.0.0.1", 0, 2, timeout_s=5))
    listening = subprocess.run(
        ["ss", "-ltnH", f"sport = :{sender.spec.port}"], capture_output=True, text=True
    )
    addresses = {line.split()[3].rsplit(":", 1)[0] for line in listening.stdout.splitlines()}
    assert addresses == {"127.0.0.1"}


def test_a_spec_of_another_secret_or_size_fails_at_once_and_says_which() -> None:
    sender = WeightSender(SyncGroupSpec("127.0.0.1", 0, 2, timeout_s=20))
    with pytest.raises(RefitError, match="failed its check against this spec's secret"):
        SyncGroup(dataclasses.replace(sender.spec, secret=auth.new_secret()), 1)
    with pytest.raises(RefitError, match="has 2 ranks, this spec 3"):
        SyncGroup(dataclasses.replace(sender.spec, world_size=3), 1)


def test_the_secret_stays_out_of_reprs_and_each_spec_has_its_own() -> None:
    a, b = SyncGroupSpec("127.0.0.1", 0, 2), SyncGroupSpec("127.0.0.1", 0, 2)
    assert a.secret != b.secret and a.secret not in repr(a)


# ---- what a failing group raises: typed, bounded, stale only when part of an update arrived --------


def test_bad_specs_are_refit_errors_naming_every_problem() -> None:
    with pytest.raises(RefitError) as info:
        SyncGroupSpec("", 70000, 2, "gloo", timeout_s=-1, secret="short")
    assert [p.split()[0] for p in info.value.problems] == ["port", "timeout_s", "address", "secret:"]


def test_a_port_in_use_is_a_refit_error() -> None:
    first = WeightSender(SyncGroupSpec("127.0.0.1", 0, 2))
    with pytest.raises(
        RefitError, match=f"cannot host the weight-sync group's store at 127.0.0.1:{first.spec.port}"
    ):
        WeightSender(dataclasses.replace(first.spec))


def test_a_sender_no_engine_joins_is_a_refit_error_after_its_timeout() -> None:
    sender = WeightSender(SyncGroupSpec("127.0.0.1", 0, 2, timeout_s=2))
    with pytest.raises(RefitError, match=r"rank\(s\) \[1\] of 2 did not join"):
        sender.connect()


def test_a_rank_that_never_comes_fails_the_join_within_its_deadline_naming_it() -> None:
    """The join deadline, not the transfer timeout (600 s here), bounds a join one rank never
    makes; the others are told which rank it is."""
    sender = WeightSender(SyncGroupSpec("127.0.0.1", 0, 3, timeout_s=600, join_timeout_s=3))
    errors: list[RefitError] = []

    def engine() -> None:
        with pytest.raises(RefitError) as info:
            SyncGroup(sender.spec, 1)
        errors.append(info.value)

    joined = threading.Thread(target=engine)
    joined.start()
    with pytest.raises(RefitError, match=r"rank\(s\) \[2\] of 3 did not join .* join deadline \(3 s"):
        sender.connect()
    joined.join(60)
    assert not joined.is_alive() and "rank(s) [2] of 3 did not join" in str(errors[0])


@pytest.mark.parametrize("rank", [0, 1])
def test_a_silent_process_in_a_ranks_slot_fails_the_join_within_its_deadline(rank: int) -> None:
    """A process without the secret that joins as a member (here rank 0's or rank 1's slot,
    then says nothing: a stand-in, it takes no part in the authentication) holds the others
    only until the join deadline, and the error says a joined rank did not authenticate."""
    host = WeightSender(SyncGroupSpec("127.0.0.1", 0, 2, timeout_s=600, join_timeout_s=5))
    spec = host.spec
    silent = threading.Event()

    def squatter() -> None:
        store = dist.TCPStore(spec.address, spec.port, is_master=False, timeout=timedelta(seconds=30))
        store.set(f"rollgen-weight-sync/joined/{rank}", "1")
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=spec.address)]
        dist.ProcessGroupGloo(dist.PrefixStore("rollgen-weight-sync", store), rank, 2, options)
        silent.wait(60)  # in the slot, silent

    thread = threading.Thread(target=squatter, daemon=True)
    thread.start()
    try:
        with pytest.raises(RefitError, match="authenticated: a rank that joined did not take part"):
            if rank == 0:
                SyncGroup(spec, 1)
            else:
                host.connect()
    finally:
        silent.set()
        thread.join(60)


def test_a_join_deadline_longer_than_the_timeout_is_refused() -> None:
    with pytest.raises(RefitError, match=r"join_timeout_s 30: .* at most timeout_s \(10\)"):
        SyncGroupSpec("127.0.0.1", 0, 2, timeout_s=10, join_timeout_s=30)
    assert SyncGroupSpec("127.0.0.1", 0, 2, timeout_s=10).join_deadline_s == 10
    assert SyncGroupSpec("127.0.0.1", 0, 2).join_deadline_s == 60


def test_engines_that_never_receive_fail_the_send_typed_and_unstale() -> None:
    sender = WeightSender(SyncGroupSpec("127.0.0.1", 0, 2, timeout_s=3))
    joined = threading.Thread(target=lambda: SyncGroup(sender.spec, 1))
    joined.start()
    sender.connect()
    joined.join()
    with pytest.raises(RefitError, match="broke while sharing a message") as info:
        sender.send(source())
    assert not info.value.stale
    with pytest.raises(RefitError, match="broke earlier"):
        sender.send(source())


def test_an_engine_whose_sender_never_sends_is_not_stale_and_keeps_serving(cpu_config: dict) -> None:
    import rollgen

    with rollgen.create_generation(cpu_config) as gen:
        sender = WeightSender(gen.weight_sync_spec("127.0.0.1", timeout_s=3))
        connecting = threading.Thread(target=sender.connect)
        connecting.start()
        gen.init_weight_sync(sender.spec)
        connecting.join()
        with pytest.raises(RefitError, match="nothing of this update was applied") as info:
            gen.update_weights_from_collective()
        assert not info.value.stale
        ids = torch.tensor([[5, 6, 7]])
        gen.generate({"input_ids": ids, "input_lengths": torch.tensor([3])})  # not stale


@pytest.mark.parametrize("address", ["127.0.0.1", "no-such-host.invalid"])
def test_an_engine_that_cannot_reach_the_store_is_a_refit_error(cpu_config: dict, address: str) -> None:
    import rollgen

    with rollgen.create_generation(cpu_config) as gen:
        closed = socket.create_server(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        closed.close()
        spec = dataclasses.replace(gen.weight_sync_spec(address, timeout_s=2), port=port)
        with pytest.raises(RefitError, match="could not join the group"):
            gen.init_weight_sync(spec)
        assert gen.weight_sync is None


def test_nccl_on_engines_without_gpus_is_refused_before_anyone_joins(cpu_config: dict) -> None:
    import rollgen

    with rollgen.create_generation(cpu_config) as gen:
        with pytest.raises(RefitError, match="needs the engines on CUDA GPUs"):
            gen.init_weight_sync(SyncGroupSpec("127.0.0.1", 29999, 2, "nccl", 5.0))


def test_sending_to_a_generation_that_shut_down_is_a_refit_error(cpu_config: dict) -> None:
    import rollgen
    from rollgen.testing.reference import load_reference_model

    gen = rollgen.create_generation(cpu_config)
    sender = WeightSender(gen.weight_sync_spec("127.0.0.1", timeout_s=3))
    connecting = threading.Thread(target=sender.connect)
    connecting.start()
    gen.init_weight_sync(sender.spec)
    connecting.join()
    gen.shutdown()
    with pytest.raises(RefitError, match="broke while"):
        sender.send(load_reference_model(cpu_config["model_name"], torch.float32).state_dict())
