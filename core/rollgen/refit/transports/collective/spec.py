"""A weight-sync group's spec: where the group meets, how many ranks it has, its backend and
timeouts, and the secret that makes a rank a member."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from rollgen import auth
from rollgen.errors import RefitError

SyncBackend = Literal["gloo", "nccl"]


@dataclass(frozen=True)
class SyncGroupSpec:
    """Where a weight-sync group meets, and the secret that makes a rank a member.

    Args:
        address, port: where the sender (rank 0) hosts the group's TCP store, listening on that
            address only (port 0: a free one).
        world_size: 1 + the engine ranks.
        backend: "gloo" (CPU) or "nccl" (CUDA).
        secret: fresh for each spec unless given.

    Raises:
        RefitError: listing every invalid field.

    Every rank proves it holds the secret before anything is sent, and every manifest and error
    carries its tag. Hand the spec itself on (the trainer's process to the generation's): never
    the secret over the group's own network in the clear."""

    address: str
    port: int
    world_size: int
    backend: SyncBackend = "gloo"
    #: How long a rank waits for the others during a broadcast.
    timeout_s: float = 600.0
    secret: str = field(default_factory=auth.new_secret, repr=False)
    #: How long a rank waits for every rank to join and authenticate (None: the lesser of 60 s
    #: and ``timeout_s``): a rank that never comes, or a process without the secret in a rank's
    #: slot, fails the join within it, not within ``timeout_s``.
    join_timeout_s: float | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.backend not in ("gloo", "nccl"):
            problems.append(f"backend {self.backend!r}: use 'gloo' (CPU) or 'nccl' (CUDA)")
        if not isinstance(self.world_size, int) or self.world_size < 2:
            problems.append(
                f"world_size {self.world_size!r}: a group has a sender and at least one engine rank (>= 2)"
            )
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            problems.append(f"port {self.port!r}: an integer in [0, 65535] (0: a free one)")
        if (
            not isinstance(self.timeout_s, (int, float))
            or not math.isfinite(self.timeout_s)
            or self.timeout_s <= 0
        ):
            problems.append(f"timeout_s {self.timeout_s!r}: a finite number of seconds > 0")
        elif self.join_timeout_s is not None and not (
            isinstance(self.join_timeout_s, (int, float))
            and math.isfinite(self.join_timeout_s)
            and 0 < self.join_timeout_s <= self.timeout_s
        ):
            problems.append(
                f"join_timeout_s {self.join_timeout_s!r}: a finite number of seconds > 0, at most "
                f"timeout_s ({self.timeout_s}), or None"
            )
        if not isinstance(self.address, str) or not self.address:
            problems.append(f"address {self.address!r}: the sender's host name or IP address")
        if not isinstance(self.secret, str) or len(self.secret) < 32:
            problems.append("secret: at least 32 characters (leave it out: each spec makes a fresh one)")
        if problems:
            raise RefitError("invalid weight-sync group spec", problems)

    @property
    def where(self) -> str:
        return f"{self.address}:{self.port}"

    @property
    def join_deadline_s(self) -> float:
        """How long a rank waits for the others to join and authenticate."""
        return min(60.0, self.timeout_s) if self.join_timeout_s is None else self.join_timeout_s
