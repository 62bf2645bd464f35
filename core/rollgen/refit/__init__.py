"""Weight refit: the trainer's buckets, the transports, the checks before anything is applied, and
the engine rank's side of each.

Transports (``rollgen.refit.transports``, one module per transport holding both its ends;
``WeightBucket.transport`` names one, ``WeightBucket.via`` is it):
- ``tensors``: the tensors themselves (in-process, or copied through the Ray object store);
- ``shared_memory``: CPU tensors in shared memory, sent as a few KB of handles (zero-copy when the
  trainer's tensors already live in shared memory; otherwise one bucket-sized copy). Handles are
  made each time the bucket is pickled, one set per receiver, so pack it in the process that
  sends it to the engines (across processes, use ``tensors``);
- ``cuda_ipc``: CUDA IPC handles keyed by device UUID, for trainer and engine on the same GPUs;
- ``collective``: a weight-sync group broadcasting over gloo or NCCL from a trainer elsewhere (a
  package: its spec, wire messages, group, sender, receiver and transport).

Modules: ``meta`` (names, ``TensorMeta``, ``WeightSpec``, module groups, flat layouts), ``checks``
(source, spec, reach, finiteness), ``bucket`` (packing, sizes, merging), ``layouts``
(``KeptLayouts``, on every end), ``receiver`` (the rank's end: unpacking, kept layouts),
``staging`` and ``in_place`` (the trainer's persistent GPU buffers, or its own tensors read in
place) and ``channel`` (both ends of a driver ↔ rank socket); ``updates`` (``WeightUpdates``, one
update's lifecycle) over ``link`` (what it asks of the engines, and ``EngineFacts``).
"""

from rollgen.refit.bucket import (
    DEFAULT_BUCKET_BYTES,
    GPU_BUCKET_BYTES,
    WeightBucket,
    bucket_groups,
    default_bucket_bytes,
    gpu_bucket_bytes,
    grouped,
    iter_buckets,
    merge_buckets,
    named_tensors,
    pack_bucket,
)
from rollgen.refit.checks import (
    GraphedCheck,
    check_against_spec,
    check_bucket_bytes,
    check_reach,
    check_source,
    graphed,
    nonfinite,
    reject_nonfinite,
    require_finite,
)
from rollgen.refit.layouts import KEPT_LAYOUTS, KeptLayouts
from rollgen.refit.link import EngineFacts, EngineLink, InProcessLink, Packing
from rollgen.refit.meta import (
    FLAT_ALIGN,
    Named,
    TensorMeta,
    Transport,
    WeightSpec,
    copy_into,
    dtype_name,
    flat_offsets,
    flatten,
    mirror,
    module_group,
    unflatten,
)
from rollgen.refit.receiver import Receiver, load_into_module, release_staged
from rollgen.refit.transports import BucketTransport, transport_named
from rollgen.refit.transports.collective import SyncBackend, SyncGroup, SyncGroupSpec, WeightSender, receive
from rollgen.refit.transports.cuda_ipc import InPlaceViews, IpcHandle, device_uuid, ipc_targets
from rollgen.refit.updates import WeightUpdates

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "FLAT_ALIGN",
    "GPU_BUCKET_BYTES",
    "KEPT_LAYOUTS",
    "BucketTransport",
    "EngineFacts",
    "EngineLink",
    "GraphedCheck",
    "InProcessLink",
    "InPlaceViews",
    "IpcHandle",
    "KeptLayouts",
    "Named",
    "Packing",
    "Receiver",
    "SyncBackend",
    "SyncGroup",
    "SyncGroupSpec",
    "TensorMeta",
    "Transport",
    "WeightBucket",
    "WeightSender",
    "WeightSpec",
    "WeightUpdates",
    "bucket_groups",
    "check_against_spec",
    "check_bucket_bytes",
    "check_reach",
    "check_source",
    "copy_into",
    "default_bucket_bytes",
    "device_uuid",
    "dtype_name",
    "flat_offsets",
    "flatten",
    "gpu_bucket_bytes",
    "graphed",
    "grouped",
    "ipc_targets",
    "iter_buckets",
    "load_into_module",
    "merge_buckets",
    "mirror",
    "module_group",
    "named_tensors",
    "nonfinite",
    "pack_bucket",
    "receive",
    "reject_nonfinite",
    "release_staged",
    "require_finite",
    "transport_named",
    "unflatten",
]
