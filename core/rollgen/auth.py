"""Shared secrets and the HMAC-SHA256 checks built on them: how rollgen's own sockets (refit
channels, weight-sync groups) tell their members from anyone else who reaches them.

A secret is made by the side that opens the socket and handed to its peers out of band (over
Ray, or in the ``SyncGroupSpec`` the trainer passes on); it never crosses the socket itself.
A peer proves it holds the secret by a tag over fresh nonces from both sides, so a tag seen on
the wire cannot be replayed."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct

NONCE_BYTES = 32
TAG_BYTES = hashlib.sha256().digest_size


class AuthenticationFailed(Exception):
    """A peer did not prove it holds the secret (or spoke out of turn). Internal: callers raise
    the typed error their surface promises."""


def new_secret() -> str:
    """A fresh secret, as hex (it travels in specs and configs as text)."""
    return secrets.token_hex(32)


def nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def tag(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``parts``, each length-prefixed (no two part lists share a message)."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(struct.pack(">Q", len(part)))
        mac.update(part)
    return mac.digest()


def verify(key: bytes, expected_parts: tuple[bytes, ...], received: bytes) -> bool:
    """Whether ``received`` is the tag of ``expected_parts`` (compared in constant time)."""
    return hmac.compare_digest(tag(key, *expected_parts), received)


def handshake(sock: socket.socket, key: bytes, *, initiator: bool) -> None:
    """Mutual challenge-response over a connected socket (both ends call it, one as the
    ``initiator``): each sends a nonce, then the tag of both nonces and its role. Raises
    ``AuthenticationFailed`` (or ``OSError``, e.g. the socket's timeout) unless the peer holds
    ``key``. Fixed-size messages: nothing the peer sends is interpreted before it is checked."""
    mine = nonce()
    sock.sendall(mine)
    theirs = _recv_exactly(sock, NONCE_BYTES)
    me, peer = (b"initiator", b"acceptor") if initiator else (b"acceptor", b"initiator")
    sock.sendall(tag(key, me, theirs, mine))
    if not verify(key, (peer, mine, theirs), _recv_exactly(sock, TAG_BYTES)):
        raise AuthenticationFailed("the peer does not hold the key")


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise AuthenticationFailed("the peer closed the connection during the handshake")
        data += chunk
    return data
