"""The wire protocol of TCPStore, shared by the server and the client.

Connection set-up (the server speaks first, so a client can tell it reached an spmd store):

    server -> client   HELLO:  magic "SPMDSTR1", flags (bit 0: token required), the largest
                               request it accepts (u64), nonce_s[32]
    client -> server   CLIENT: magic, rank (i32, -1 unknown), and with a token:
                               nonce_c[32], HMAC-SHA256(token, "client" + nonce_s + nonce_c)
    server -> client   ACCEPT: status (0 ok, 1 refused), and with a token:
                               HMAC-SHA256(token, "server" + nonce_c + nonce_s)

The token never crosses the wire and both sides prove they hold it. Nothing the client
sends is interpreted as a command before ACCEPT.

Then every request is one frame. Every request gets exactly one response frame, except
SET, MULTI_SET, APPEND and QUEUE_PUSH, which get none (as in PyTorch's store, a set costs
no round trip; frames of one connection are applied in order, so the client's next request
sees its own writes):

    header  <B q I   command (or status), an integer argument, payload length
    payload          a sequence of byte strings, each <I length + bytes

A payload whose strings do not add up to its length, a length above the server's cap,
or an unknown command makes the server drop that connection (and log why); every other
connection and every key is unaffected.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

MAGIC = b"SPMDSTR1"
NONCE_BYTES = 32
HELLO = struct.Struct("<8sBQ32s")
CLIENT_HELLO = struct.Struct("<8si")
FLAG_AUTH = 1
ACCEPT_OK, ACCEPT_REFUSED = 0, 1

HEADER = struct.Struct("<BqI")
LENGTH = struct.Struct("<I")

# Commands. The integer header field carries: a timeout in ms (GET, WAIT, WAIT_WORKERS),
# an amount (ADD), or a worker count (WAIT_WORKERS uses the first payload string).
SET = 1  # key, value
GET = 2  # keys...            -> values...       (blocks; int = timeout ms)
ADD = 3  # key                -> int = new value (int = amount)
COMPARE_SET = 4  # key, expected, desired -> value
WAIT = 5  # keys...           -> ok              (blocks; int = timeout ms)
CHECK = 6  # keys...          -> int = 0/1
DELETE = 7  # key             -> int = 0/1
NUM_KEYS = 8  #               -> int
MULTI_SET = 9  # key, value, key, value, ...
APPEND = 10  # key, value
JOIN = 11  #                  -> int = participants joined so far
WAIT_WORKERS = 12  # count    -> int = joined     (blocks; int = timeout ms)
PING = 13  #                  -> ok
# Queues live beside the keys (torch's queue_push/queue_pop/queue_len): a queue with items
# counts as an existing key for CHECK and WAIT, as in PyTorch's TCPStore.
QUEUE_PUSH = 14  # key, value
QUEUE_POP = 15  # key          -> value          (blocks; int = timeout ms; -1: do not wait)
QUEUE_LEN = 16  # key          -> int
NO_REPLY = frozenset({SET, MULTI_SET, APPEND, QUEUE_PUSH})

COMMAND_NAMES = {
    SET: "set", GET: "get", ADD: "add", COMPARE_SET: "compare_set", WAIT: "wait",
    CHECK: "check", DELETE: "delete_key", NUM_KEYS: "num_keys", MULTI_SET: "multi_set",
    APPEND: "append", JOIN: "join", WAIT_WORKERS: "wait_for_workers", PING: "ping",
    QUEUE_PUSH: "queue_push", QUEUE_POP: "queue_pop", QUEUE_LEN: "queue_len",
}

# Response status.
OK = 0
TIMEOUT = 1  # payload: the keys still missing
ERROR = 2  # payload: one message
EMPTY = 3  # a QUEUE_POP that may not block found the queue empty


def frame(code: int, number: int, parts: list[bytes] | tuple[bytes, ...] = ()) -> list[bytes]:
    """A frame as a list of buffers for ``socket.sendmsg`` (no copy of large values)."""
    bufs: list[bytes] = [b""]
    size = 0
    for part in parts:
        bufs.append(LENGTH.pack(len(part)))
        bufs.append(part)
        size += LENGTH.size + len(part)
    bufs[0] = HEADER.pack(code, number, size)
    return bufs


def split(payload: memoryview | bytes) -> list[bytes]:
    """The byte strings of a payload; ``ValueError`` when the lengths do not add up."""
    out = []
    pos, n = 0, len(payload)
    unpack = LENGTH.unpack_from
    while pos < n:
        if pos + LENGTH.size > n:
            raise ValueError(f"payload ends inside a length prefix at byte {pos}")
        (length,) = unpack(payload, pos)
        pos += LENGTH.size
        if pos + length > n:
            raise ValueError(
                f"string of {length} bytes at byte {pos} overruns the {n}-byte payload"
            )
        out.append(bytes(payload[pos : pos + length]))
        pos += length
    return out


def mac(token: bytes, label: bytes, *nonces: bytes) -> bytes:
    return hmac.new(token, label + b"".join(nonces), hashlib.sha256).digest()


def same(a: bytes, b: bytes) -> bool:
    """Constant-time comparison of two MACs."""
    return hmac.compare_digest(a, b)
