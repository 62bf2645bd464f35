"""Refit transports, one module per transport holding both its ends (vLLM's
``distributed/weight_transfer/`` is the model): ``tensors``, ``shared_memory`` and ``cuda_ipc``
(bucket transports, ``BucketTransport``, named by ``WeightBucket.transport``), and
``collective`` (a package: a weight-sync group's spec, sender and receivers; imported on its own,
as ``rollgen.refit.transports.collective``)."""

from rollgen.refit.transports.base import TRANSPORTS, BucketTransport, Packed, transport_named
from rollgen.refit.transports.cuda_ipc import CUDA_IPC, CudaIpc
from rollgen.refit.transports.shared_memory import SHARED_MEMORY, SharedMemory
from rollgen.refit.transports.tensors import TENSORS, Tensors

__all__ = [
    "CUDA_IPC",
    "SHARED_MEMORY",
    "TENSORS",
    "TRANSPORTS",
    "BucketTransport",
    "CudaIpc",
    "Packed",
    "SharedMemory",
    "Tensors",
    "transport_named",
]
