"""Ray orchestration on real Ray: tied groups, a simulated two-node cluster, worker faults."""

import pytest
import ray
import torch

from rollgen import BatchedDataDict, ConfigError, InputError, WorkerError
from rollgen.distributed import RayVirtualCluster, RayWorkerBuilder, RayWorkerGroup
from rollgen.distributed.worker_groups import TiedGroup, tied_groups

PROBE = "rollgen.testing.probe:ProbeWorker"


def test_tied_groups_are_consecutive_bundles_on_one_node() -> None:
    assert tied_groups([4, 2], 2) == [TiedGroup(0, (0, 1)), TiedGroup(0, (2, 3)), TiedGroup(1, (0, 1))]
    assert tied_groups([3], 2) == [TiedGroup(0, (0, 1))]
    with pytest.raises(ConfigError, match="no tensor-parallel group of 4 fits"):
        tied_groups([2, 2], 4)


@pytest.fixture
def two_node_cluster():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    nodes = [cluster.add_node(num_cpus=1, num_gpus=2) for _ in range(2)]
    ray.init(address=cluster.address, include_dashboard=False)
    yield nodes
    ray.shutdown()
    cluster.shutdown()


def test_bundles_across_two_simulated_nodes(two_node_cluster) -> None:
    vc = RayVirtualCluster([2, 2], use_gpus=True, cpus_per_bundle=0.25)
    try:
        pg_nodes = vc.node_ids()
        assert len(set(pg_nodes)) == 2, "one placement group per node"
        group = RayWorkerGroup(
            vc, RayWorkerBuilder(PROBE, "t"), tp_size=2, leader_resources={"num_cpus": 0.1, "num_gpus": 0}
        )
        where = group.call_all("where")
        assert [w["bundles"] for w in where] == [(0, 1), (0, 1)]
        assert [w["node"] for w in where] == pg_nodes
        group.shutdown()
        single = RayWorkerGroup(
            vc, RayWorkerBuilder(PROBE, "t"), tp_size=1, leader_resources={"num_cpus": 0.1, "num_gpus": 0.5}
        )
        assert single.dp_size == 4
        assert [w["bundles"] for w in single.call_all("where")] == [(0,), (1,), (0,), (1,)]
        single.shutdown()
    finally:
        vc.shutdown()
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


@pytest.fixture
def probes():
    if ray.is_initialized():
        ray.shutdown()
    vc = RayVirtualCluster([2], use_gpus=False, cpus_per_bundle=0.5)
    group = RayWorkerGroup(vc, RayWorkerBuilder(PROBE, "t"), tp_size=1, leader_resources={"num_cpus": 0.25})
    yield group
    group.shutdown()
    vc.shutdown()
    ray.shutdown()


def test_uneven_shards_merge_in_order(probes) -> None:
    data = BatchedDataDict({"x": torch.arange(5).unsqueeze(1), "tag": list("abcde")})
    out = BatchedDataDict.from_batches(
        probes.call_sharded("echo", data.shard_by_batch_size(2, allow_uneven_shards=True))
    )
    assert out["x"].flatten().tolist() == [0, 1, 2, 3, 4] and out["tag"] == list("abcde")
    one = BatchedDataDict.from_batches(
        probes.call_sharded("echo", data.slice(0, 1).shard_by_batch_size(2, allow_uneven_shards=True))
    )
    assert one["tag"] == ["a"], "empty shards are not sent"


def test_raising_and_dying_workers_surface_as_worker_error(probes) -> None:
    with pytest.raises(WorkerError) as info:
        probes.call_all("fail")
    assert info.value.worker == "rollgen-dp0" and "ZeroDivisionError" in info.value.remote_traceback
    with pytest.raises(InputError) as typed:
        probes.call_all("fail_typed")
    assert typed.value.samples == [3]
    ref = probes.workers[1].die.remote()
    with pytest.raises(WorkerError, match="rollgen-dp1.*died"):
        probes.get([ref], names=["rollgen-dp1"], timeout_s=60)
    with pytest.raises(WorkerError, match="died"):
        probes.call_all("where")


@pytest.fixture
def one_gpu_node():
    """A simulated node with one (logical) GPU."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 1})
    ray.init(address=cluster.address, include_dashboard=False)
    yield
    ray.shutdown()
    cluster.shutdown()


def test_fractional_gpu_bundles_share_one_gpu(one_gpu_node) -> None:
    shared = [
        RayVirtualCluster([1], use_gpus=True, cpus_per_bundle=0.25, gpus_per_bundle=0.25) for _ in range(3)
    ]
    try:
        group = RayWorkerGroup(
            shared[0],
            RayWorkerBuilder(PROBE, "t"),
            tp_size=1,
            leader_resources={"num_cpus": 0.1, "num_gpus": 0.125},
        )
        assert group.dp_size == 1
        group.shutdown()
        with pytest.raises(ConfigError, match="could not reserve"):
            RayVirtualCluster([1], use_gpus=True, cpus_per_bundle=0.25, ready_timeout_s=3)
    finally:
        for vc in shared:
            vc.shutdown()
    with pytest.raises(ConfigError, match="gpus_per_bundle"):
        RayVirtualCluster([1], use_gpus=True, gpus_per_bundle=1.5)
