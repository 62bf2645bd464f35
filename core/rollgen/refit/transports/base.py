"""The small base every bucket transport implements: both ends of one way a bucket's tensors
reach an engine (the trainer's pack, what each receiver is sent, the receiver's unpack and
release), and the table of them by name (``Packet.transport``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from rollgen.errors import RefitError
from rollgen.refit.meta import TensorMeta, Transport
from rollgen.spec import Capability


class Packet(Protocol):
    """What a transport reads and writes of a bucket (``rollgen.refit.bucket.Packet``)."""

    transport: Transport
    metas: tuple[TensorMeta, ...]
    payload: Any
    offsets: tuple[int, ...]
    held: list[torch.Tensor]


@dataclass
class Packed:
    """What a transport's ``pack`` makes of a bucket's tensors: the payload a receiver gets, the
    byte offset of each tensor in a flat buffer (where there is one), and what the sender keeps
    alive while receivers read it."""

    payload: Any
    offsets: tuple[int, ...] = ()
    held: list[torch.Tensor] = field(default_factory=list)


class BucketTransport(ABC):
    """One transport, both ends. Subclasses set ``name`` (the ``Packet.transport`` it
    takes) and ``capability`` (what a backend declares to take it), and implement ``pack`` and
    ``unpack``."""

    name: ClassVar[Transport]
    capability: ClassVar[Capability]
    #: Whether one pickle of a bucket may go to several receivers as it is (False: each receiver
    #: gets a pickle made for it, as ``Packet.__getstate__`` makes one per pickle).
    shared_pickle: ClassVar[bool] = True
    #: Whether a refit over it packs into staging buffers kept between refits, where every engine
    #: reports its GPUs (``rollgen.refit.staging``).
    stages: ClassVar[bool] = False
    #: The transport that takes host tensors to engines fed over this one (a replacement
    #: engine's catch-up from the driver's retained copies).
    host: ClassVar[Transport] = "tensors"

    # ---- the trainer's end ----------------------------------------------------------------------
    @abstractmethod
    def pack(
        self, tensors: list[torch.Tensor], metas: tuple[TensorMeta, ...], devices: Sequence[str] | None
    ) -> Packed:
        """Pack contiguous ``tensors`` (cast already, described by ``metas``); ``devices``: the
        engines' GPUs (UUIDs), for transports that reach them."""

    def check_reach(self, payload: Any, engine_devices: Sequence[str]) -> None:  # noqa: B027 - reaches every engine
        """Check, before anything is sent, that a bucket's ``payload`` reaches every engine GPU
        ``engine_devices`` (RefitError if not)."""

    def merge(self, payloads: Sequence[Any]) -> Any:
        """One payload from several trainer ranks' payloads of the same tensors.

        Raises:
            RefitError: this transport's buckets do not merge."""
        raise RefitError(f"merge_buckets merges cuda_ipc buckets; a rank packed {self.name!r}")

    # ---- what each receiver is sent -------------------------------------------------------------
    def pickled_payload(self, bucket: Packet) -> Any:
        """The payload a pickle of ``bucket`` carries (made once per pickle)."""
        return bucket.payload

    # ---- the receiver's end ---------------------------------------------------------------------
    def resolve(self, bucket: Packet) -> None:  # noqa: B027 - nothing to map by default
        """Map a received ``bucket`` into this process (once), so it can be unpacked here and
        sent onwards."""

    @abstractmethod
    def unpack(self, bucket: Packet, device: torch.device | str | None) -> list[torch.Tensor]:
        """The bucket's tensors in this process, in the order of its metas (``device``: the GPU
        to map them on, where the transport maps; None: this process's)."""

    def local(self, bucket: Packet) -> list[torch.Tensor]:
        """The bucket's tensors in the process that packed it or received it (a packer reads
        its own buffers)."""
        return self.unpack(bucket, None)

    def release(self, keys: Iterable[str]) -> None:  # noqa: B027 - nothing kept by default
        """Let go of what this process keeps mapped under ``keys`` (the sender frees it once
        every receiver has)."""


#: Every bucket transport by name (filled by ``rollgen.refit.transports``).
TRANSPORTS: dict[str, BucketTransport] = {}


def register(transport: BucketTransport) -> BucketTransport:
    """Add ``transport`` to ``TRANSPORTS`` under its name."""
    TRANSPORTS[transport.name] = transport
    return transport


def transport_named(name: str) -> BucketTransport:
    """The transport called ``name``.

    Raises:
        RefitError: for an unknown name, listing the known ones."""
    try:
        return TRANSPORTS[name]
    except (KeyError, TypeError):
        raise RefitError(f"unknown refit transport {name!r}; use {', '.join(sorted(TRANSPORTS))}") from None
