"""The RPC wire format: message kinds, the header frame and the connection handshake.

Every agent binds one ROUTER socket and receives everything on it. To send, a worker
connects one DEALER socket per peer (shared by its threads under a lock) to that peer's
ROUTER; DEALERs only send. A message is one ZeroMQ multipart message:

    header     HEADER: version, kind, flags, request id, autograd context id, autograd
               message id (-1 when none)
    payload    pickle protocol 5 of the call or the result; large buffers out of band
    [lent]     with FLAG_LENT: LENT_HEAD, then LENT_ITEM per out-of-band buffer: whether
               it is the next frame or a region of the sender's memory to read
    buffers    one frame per out-of-band buffer that travels inline

Handshake (each DEALER connection, before anything else is accepted from it):

    DEALER -> ROUTER   HELLO  MAGIC, sender rank (i32), nonce_c[32]
    ROUTER -> DEALER   CHAL   flags (bit 0: token required), server rank (i32),
                              cma (1: I can read your memory), nonce_s[32],
                              HMAC(token, "server" + nonce_c + nonce_s) or b""
    DEALER -> ROUTER   AUTH   HMAC(token, "client" + nonce_s + nonce_c) or b""
    ROUTER -> DEALER   OK | NO reason

Nothing from a connection is unpickled before its AUTH checked out; a connection that
sends anything else first is dropped with a log line. The token never crosses the wire.
"""

from __future__ import annotations

import enum
import struct

from spmd.runtime.store.protocol import NONCE_BYTES, mac, same

__all__ = ["Kind", "HEADER", "VERSION", "FLAG_LENT", "LENT_HEAD", "LENT_ITEM", "MAGIC",
           "REQUESTS", "RETRIED", "UNCOUNTED", "NONCE_BYTES", "mac", "same"]

MAGIC = b"SPMDRPC1"
VERSION = 1
HEADER = struct.Struct("<BBHIqqq")  # version, kind, flags, pad, request id, ctx id, grad msg id
FLAG_LENT = 1
LENT_HEAD = struct.Struct("<qI")  # lend id, count
LENT_ITEM = struct.Struct("<BQQ")  # 0 inline frame / 1 read from the sender, address, bytes
RANK = struct.Struct("<i")
CHAL = struct.Struct("<BiB")  # flags, server rank, cma


class Kind(enum.IntEnum):
    """Message types; fault injection and retries are chosen by these names."""

    CALL = 1  # run a function, answer with its result
    REMOTE = 2  # run a function, keep the result as an owner RRef, answer when done
    FETCH = 3  # the value of an owner RRef (to_here)
    RREF_FORK = 4  # child -> owner: register my fork of your RRef
    RREF_ACCEPT = 5  # child -> parent: the owner knows my fork, drop yours
    RREF_DELETE = 6  # user -> owner: my fork is gone
    RELEASE = 7  # receiver -> sender: I have read the buffers you lent me
    AUTOGRAD_BACKWARD = 8  # gradients for the tensors of one recorded send
    AUTOGRAD_CLEANUP = 9  # a distributed autograd context ended
    SHUTDOWN = 10  # the graceful-shutdown rounds
    AUTOGRAD_DONE = 11  # a part of a backward ended: its credit (or failure) to the root
    RESPONSE = 20
    ERROR = 21


REQUESTS = frozenset(k for k in Kind if k < Kind.RESPONSE)
# Control messages are idempotent on the receiver (deduplicated by request id) and sent
# again until answered, as PyTorch's agent does with its RRef and cleanup messages.
RETRIED = frozenset({Kind.RREF_FORK, Kind.RREF_ACCEPT, Kind.RREF_DELETE, Kind.RELEASE,
                     Kind.AUTOGRAD_CLEANUP})
# Requests that a thread waiting in their distributed autograd context runs itself, not
# the pool (the header's context id routes them; they join no context): a backward's
# passes and ends, on the worker whose ``backward`` waits for them.
ROUTED = frozenset({Kind.AUTOGRAD_BACKWARD, Kind.AUTOGRAD_DONE})
# Requests that graceful shutdown does not wait for (they are the shutdown itself).
UNCOUNTED = frozenset({Kind.SHUTDOWN})


def parse_kind(name: str) -> Kind:
    """``Kind`` from its name (``"CALL"``, ``"rref_delete"``...); ``ValueError`` otherwise."""
    if isinstance(name, Kind):
        return name
    if not isinstance(name, str):
        raise TypeError(f"message type must be a name like 'CALL', got {type(name).__name__}")
    try:
        return Kind[name.upper()]
    except KeyError:
        raise ValueError(f"unknown message type {name!r}; one of "
                         f"{', '.join(k.name for k in Kind)}") from None


def client_proof(token: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    return mac(token, b"client", nonce_s, nonce_c)


def server_proof(token: bytes, nonce_c: bytes, nonce_s: bytes) -> bytes:
    return mac(token, b"server", nonce_c, nonce_s)
