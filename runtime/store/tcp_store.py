"""TCPStore: the store every process of a job reaches over TCP.

The master process runs the server (``tcp_server.StoreServer``) in a background thread;
every participant, the master included, talks to it through one client connection. The
client never resolves a peer's name in reverse and resolves the host forward only once,
so a machine with slow DNS does not slow the job.
"""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time
import weakref
from datetime import timedelta
from typing import Sequence

from spmd.runtime import config
from spmd.runtime.errors import DistStoreError, QueueEmptyError, StoreTimeoutError
from spmd.runtime.store import protocol as P
from spmd.runtime.store.base import Store, describe_missing
from spmd.runtime.store.tcp_server import StoreServer

__all__ = ["TCPStore"]

_GRACE = 10.0  # extra seconds a client waits for the server to answer a timed-out wait
_ACCEPT = struct.Struct("<B32s")
_TIMEVAL = struct.Struct("@ll")

# Forks of this process so far: a client compares it instead of calling os.getpid() on
# every request (a system call each, with no pid cache in glibc).
_forks = 0


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)


def _limit(sock: socket.socket, seconds: float) -> None:
    """Give up a blocking send or receive after ``seconds``, in the kernel.

    Requests run on a blocking socket whose limit is SO_RCVTIMEO/SO_SNDTIMEO: a Python
    socket with a timeout polls before every send and receive, and setting the timeout
    is one more system call. An expired limit raises BlockingIOError."""
    whole = int(seconds)
    micro = max(int((seconds - whole) * 1e6), 0 if whole else 1)  # 0 s: no limit at all
    tv = _TIMEVAL.pack(whole, micro)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _token_bytes(token: str | bytes | None) -> bytes | None:
    if token is None:
        token = config.auth_token()
    if token is None or token == "" or token == b"":
        return None
    if isinstance(token, str):
        return token.encode("utf-8")
    if isinstance(token, (bytes, bytearray)):
        return bytes(token)
    raise TypeError(f"auth_token must be str or bytes, got {type(token).__name__}")


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the server closed the connection")
        got += k
    return buf


def _sendall(sock: socket.socket, bufs: list) -> None:
    total = sum(len(b) for b in bufs)
    if total < 65536:
        sock.sendall(b"".join(bufs))
        return
    views = [memoryview(b) for b in bufs if len(b)]
    while views:
        sent = sock.sendmsg(views[:512])
        while sent:
            n = len(views[0])
            if sent >= n:
                sent -= n
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


class _Transient(DistStoreError):
    """The connection dropped during the greeting: worth another try until the timeout."""


_TENANTS: dict[tuple[str, int], list] = {}  # (host, port) -> [server, users]
_TENANTS_LOCK = threading.Lock()


def _serve(host: str, port: int, token: bytes | None, multi_tenant: bool,
           listen_fd: int | None = None) -> "StoreServer":
    """A new server on ``port`` (or on the listening socket ``listen_fd``); with
    ``multi_tenant``, the one this process already serves there if any (torch's
    ``multi_tenant``: a process group and RPC on one address)."""
    with _TENANTS_LOCK:
        shared = _TENANTS.get((host, port)) if multi_tenant and port else None
        if shared is not None:
            shared[1] += 1
            return shared[0]
        server = StoreServer(host, port, auth_token=token, max_message=config.store_max_message(),
                             listen_fd=listen_fd)
        if multi_tenant:
            _TENANTS[(host, server.port)] = [server, 1]
            server._spmd_tenant_key = (host, server.port)  # type: ignore[attr-defined]
        return server


def _release(server: "StoreServer") -> None:
    """One user of ``server`` is done; the last one stops it."""
    key = getattr(server, "_spmd_tenant_key", None)
    if key is not None:
        with _TENANTS_LOCK:
            entry = _TENANTS.get(key)
            if entry is not None and entry[0] is server:
                entry[1] -= 1
                if entry[1] > 0:
                    return
                del _TENANTS[key]
    server.stop()


class TCPStore(Store):
    """A store served over TCP by the master process, used by every process of a job.

    Args:
        host_name: the master's address. On the master, the address the server binds:
            use loopback or a private interface (anyone who reaches it can read and write
            keys unless an auth token is required).
        port: the server's port. On the master, 0 picks a free one (see ``.port``).
        world_size: how many participants will join, the master included.
        is_master: run the server in a background thread of this process.
        timeout: how long blocking calls (and connecting) wait; default 300 s
            (``SPMD_STORE_TIMEOUT``).
        wait_for_workers: on the master, return from the constructor only when
            ``world_size`` participants have joined.
        multi_tenant: on the master, share the server this process already runs on the
            same host and port, if any (a process group and RPC on one ``tcp://``
            address, as torch's ``multi_tenant``); the server stops with its last user.
        master_listen_fd: on the master, serve on this already bound and listening socket
            instead of binding ``port`` (torch's: a launcher that reserved the port hands
            it over, so no other process can take it in between).
        use_libuv: accepted for torch's signature; the server is ours either way.
        auth_token: a shared secret (default ``SPMD_AUTH_TOKEN``). The server admits only
            clients that prove they hold it, by HMAC challenge-response; the token never
            crosses the wire. Every participant must be given the same token.
        rank: this participant's rank, used in error messages and the server's log.

    Example::

        server = TCPStore("127.0.0.1", 0, world_size=2, is_master=True,
                          wait_for_workers=False)
        client = TCPStore("127.0.0.1", server.port, world_size=2)
        client.set("hello", b"world")
        server.get("hello")  # -> b"world"
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: timedelta | None = None,
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        use_libuv: bool = True,
        *,
        auth_token: str | bytes | None = None,
        rank: int | None = None,
    ) -> None:
        if not isinstance(host_name, str) or not host_name:
            raise ValueError(f"TCPStore host_name must be a non-empty str, got {host_name!r}")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"TCPStore port must be an int in [0, 65535], got {port!r}")
        if not isinstance(is_master, bool):
            raise TypeError(f"is_master must be a bool, got {type(is_master).__name__}")
        if not isinstance(multi_tenant, bool):
            raise TypeError(f"multi_tenant must be a bool, got {type(multi_tenant).__name__}")
        if master_listen_fd is not None and (
                not isinstance(master_listen_fd, int) or isinstance(master_listen_fd, bool)
                or master_listen_fd < 0 or not is_master):
            raise ValueError(f"TCPStore master_listen_fd must be a listening socket's file "
                             f"descriptor on the master, got {master_listen_fd!r} with "
                             f"is_master={is_master}")
        if not isinstance(use_libuv, bool):
            raise TypeError(f"use_libuv must be a bool, got {type(use_libuv).__name__}")
        if port == 0 and not is_master:
            raise ValueError("TCPStore port 0 (pick a free port) is only valid on the master")
        if world_size is not None and (
            not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1
        ):
            raise ValueError(f"TCPStore world_size must be a positive int, got {world_size!r}")
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
            raise ValueError(f"TCPStore rank must be a non-negative int, got {rank!r}")
        super().__init__(timeout)
        self._token = _token_bytes(auth_token)
        self._host = host_name
        self._world_size = world_size
        self._rank = rank
        # One connection per thread: a thread blocked in get() never holds up another
        # thread's calls, and each thread still reads its own writes (one connection
        # applies its frames in order).
        self._local = threading.local()
        self._socks: list[socket.socket] = []
        self._socks_lock = threading.Lock()
        self._forks = _forks
        self._closed = False
        self._addrs: list | None = None
        self._server: StoreServer | None = None
        self._max_message = 1 << 62  # until the server's greeting says otherwise
        if is_master:
            self._server = _serve(host_name, port, self._token, multi_tenant,
                                  master_listen_fd)
            port = self._server.port
            self._stop_server = weakref.finalize(self, _release, self._server)
        self._port = port
        try:
            self._connection()
            self._call(P.JOIN, 0, (), "join")
            if is_master and wait_for_workers and world_size is not None:
                self._wait_for_workers(world_size)
        except BaseException:
            self.close()
            raise

    def clone(self) -> "TCPStore":
        """A new client of the same server (same token, timeout and rank)."""
        return TCPStore(self._host, self._port, self._world_size, False, self.timeout,
                        auth_token=self._token, rank=self._rank)

    # -- identity ---------------------------------------------------------------------

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        return self._port

    @property
    def world_size(self) -> int | None:
        return self._world_size

    @property
    def is_master(self) -> bool:
        return self._server is not None

    def __repr__(self) -> str:
        role = "master" if self._server else "client"
        return f"TCPStore({self._host}:{self._port}, {role}, rank={self._rank})"

    def _where(self) -> str:
        who = f" (rank {self._rank})" if self._rank is not None else ""
        return f"TCPStore {self._host}:{self._port}{who}"

    # -- connection -------------------------------------------------------------------

    def _resolve(self, deadline: float) -> list:
        delay = 0.01
        while True:
            try:
                return socket.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)
            except socket.gaierror as e:
                if time.monotonic() + delay > deadline:
                    raise DistStoreError(
                        f"{self._where()}: cannot resolve {self._host!r}: {e}"
                    ) from e
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _connection(self) -> socket.socket:
        """This thread's live socket, (re)connecting when there is none."""
        if self._forks != _forks:  # forked: the parent's sockets are not ours to use
            with self._socks_lock:
                for sock in self._socks:
                    sock.close()  # closes our copy only; the parent's stays open
                self._socks, self._forks = [], _forks
                self._local = threading.local()
        if self._closed:
            raise DistStoreError(f"{self._where()}: the store is closed")
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            return sock
        # a server this client reached before and lost: its host may be gone; say so in
        # seconds (SPMD_STORE_RECONNECT), not after the whole timeout
        lost = getattr(self, "_reached", False)
        window = min(self._timeout, config.store_reconnect()) if lost else self._timeout
        deadline = time.monotonic() + window
        if self._addrs is None:
            self._addrs = self._resolve(deadline)
        delay, last = 0.01, None
        while True:
            for family, kind, proto, _, addr in self._addrs:
                sock = socket.socket(family, kind, proto)
                try:
                    sock.settimeout(max(0.05, min(5.0, deadline - time.monotonic())))
                    sock.connect(addr)
                except OSError as e:
                    sock.close()
                    last = e
                    continue
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    self._handshake(sock, deadline)
                except _Transient as e:  # e.g. a server of a previous job shutting down
                    sock.close()
                    last = e
                    continue
                except BaseException:
                    sock.close()
                    raise
                sock.settimeout(None)
                _limit(sock, self._timeout)
                self._local.limit = self._timeout
                self._local.sock = sock
                self._reached = True
                with self._socks_lock:
                    self._socks.append(sock)
                return sock
            left = deadline - time.monotonic()
            if left <= 0 and lost:
                raise StoreTimeoutError(
                    f"{self._where()}: the store's server stopped answering (its host may "
                    f"be down): could not reconnect within {window:g}s (last error: {last})")
            if left <= 0:
                raise StoreTimeoutError(
                    f"{self._where()}: timeout: could not connect within {self._timeout:g}s "
                    f"(last error: {last})"
                )
            time.sleep(min(left, delay * (1 + random.random() * 0.25)))
            delay = min(delay * 1.5, 0.5)

    def _handshake(self, sock: socket.socket, deadline: float) -> None:
        where = self._where()
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            magic, flags, max_message, nonce = P.HELLO.unpack(_recv_exact(sock, P.HELLO.size))
        except socket.timeout:
            raise StoreTimeoutError(
                f"{where}: timeout: no greeting from the server within {self._timeout:g}s; is "
                f"something other than an spmd TCPStore listening there?"
            ) from None
        except (OSError, ConnectionError) as e:
            raise _Transient(f"{where}: connection lost during the greeting: {e}") from e
        if magic != P.MAGIC:
            raise DistStoreError(
                f"{where}: the server there is not an spmd TCPStore (greeting {magic!r}); "
                f"a torch.distributed.TCPStore speaks another protocol"
            )
        self._max_message = max_message
        wants_token = bool(flags & P.FLAG_AUTH)
        if wants_token and self._token is None:
            raise DistStoreError(
                f"{where}: the server requires an auth token; pass auth_token= or set "
                f"SPMD_AUTH_TOKEN to the job's token"
            )
        if not wants_token and self._token is not None:
            raise DistStoreError(
                f"{where}: this client has an auth token but the server does not require "
                f"one; refusing to trust it (give the master the same token)"
            )
        hello = P.CLIENT_HELLO.pack(P.MAGIC, -1 if self._rank is None else self._rank)
        client_nonce = b""
        if self._token is not None:
            client_nonce = os.urandom(P.NONCE_BYTES)
            hello += client_nonce + P.mac(self._token, b"client", nonce, client_nonce)
        try:
            sock.sendall(hello)
            status, proof = _ACCEPT.unpack(_recv_exact(sock, _ACCEPT.size))
        except socket.timeout:
            raise StoreTimeoutError(f"{where}: timeout: the server did not answer the "
                                    f"greeting") from None
        except (OSError, ConnectionError) as e:
            raise _Transient(f"{where}: connection lost during the greeting: {e}") from e
        if status != P.ACCEPT_OK:
            raise DistStoreError(f"{where}: the server refused this client: wrong auth token")
        if self._token is not None and not P.same(
            proof, P.mac(self._token, b"server", client_nonce, nonce)
        ):
            raise DistStoreError(f"{where}: the server could not prove it holds the auth token")

    def _disconnect(self) -> None:
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            self._local.sock = None
            with self._socks_lock:
                if sock in self._socks:
                    self._socks.remove(sock)
            sock.close()

    def close(self) -> None:
        """Close every connection; on the master, also stop the server. Idempotent."""
        self._closed = True
        with self._socks_lock:
            socks, self._socks = self._socks, []
        for sock in socks:
            sock.close()
        if self._server is not None:
            self._stop_server()

    # -- requests ---------------------------------------------------------------------

    def _request(
        self, cmd: int, number: int, parts: Sequence[bytes], op: str,
        keys: Sequence[str] = (), wait: float | None = None,
    ) -> tuple[int, int, bytes]:
        """Send one request, return (status, number, payload); ``wait``: seconds it may park."""
        sock = self._connection()
        bufs = P.frame(cmd, number, parts)
        size = sum(map(len, bufs)) - P.HEADER.size
        if size > self._max_message:
            raise ValueError(
                f"{self._where()}: a {op} of {size} bytes exceeds the server's "
                f"{self._max_message}-byte limit (SPMD_STORE_MAX_MESSAGE on the master)"
            )
        limit = self._timeout if wait is None else wait + _GRACE
        local = self._local
        if local.limit != limit:
            _limit(sock, limit)
            local.limit = limit
        try:
            _sendall(sock, bufs)
            if cmd in P.NO_REPLY:
                return P.OK, 0, b""
            status, result, length = P.HEADER.unpack(_recv_exact(sock, P.HEADER.size))
            payload = _recv_exact(sock, length) if length else b""
        except (socket.timeout, BlockingIOError):
            self._disconnect()
            raise StoreTimeoutError(
                f"{self._where()}: {op}: timeout: no answer from the server within {limit:g}s"
            ) from None
        except (OSError, ConnectionError) as e:
            self._disconnect()
            about = f" of {describe_missing(keys)}" if keys else ""
            raise DistStoreError(
                f"{self._where()}: lost the connection to the server during {op}{about}: {e}"
            ) from e
        return status, result, payload

    def _call(
        self, cmd: int, number: int, parts: Sequence[bytes], op: str,
        keys: Sequence[str] = (), wait: float | None = None,
    ) -> tuple[int, list[bytes]]:
        """One request; its (number, strings), or the error the server answered, raised."""
        status, result, payload = self._request(cmd, number, parts, op, keys, wait)
        if status == P.OK:
            return result, P.split(payload) if payload else []
        if status == P.TIMEOUT:
            missing = [k.decode("utf-8", "replace") for k in P.split(payload)]
            raise StoreTimeoutError(
                f"{self._where()}: {op}: timeout: timed out after {wait:g}s waiting for keys "
                f"{describe_missing(missing or keys)}"
            )
        message = P.split(payload)[0].decode("utf-8", "replace") if payload else "?"
        raise DistStoreError(f"{self._where()}: {message}")

    def _wait_for_workers(self, world_size: int) -> None:
        status, joined, _ = self._request(
            P.WAIT_WORKERS, int(self._timeout * 1000), (str(world_size).encode(),),
            "wait_for_workers", wait=self._timeout,
        )
        if status != P.OK:
            raise StoreTimeoutError(
                f"{self._where()}: timeout: only {joined} of {world_size} participants "
                f"joined within {self._timeout:g}s"
            )

    # -- Store ------------------------------------------------------------------------

    def _set(self, key: str, value: bytes) -> None:
        self._call(P.SET, 0, (key.encode(), value), "set", (key,))

    def _multi_get(self, keys: list[str], timeout: float) -> list[bytes]:
        op = "get" if len(keys) == 1 else "multi_get"
        return self._call(
            P.GET, int(timeout * 1000), [k.encode() for k in keys], op, keys, timeout
        )[1]

    def _wait(self, keys: list[str], timeout: float) -> None:
        self._call(P.WAIT, int(timeout * 1000), [k.encode() for k in keys], "wait", keys, timeout)

    def _add(self, key: str, amount: int) -> int:
        return self._call(P.ADD, amount, (key.encode(),), "add", (key,))[0]

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._call(P.COMPARE_SET, 0, (key.encode(), expected, desired), "compare_set")[1][0]

    def _check(self, keys: list[str]) -> bool:
        return bool(self._call(P.CHECK, 0, [k.encode() for k in keys], "check")[0])

    def _delete_key(self, key: str) -> bool:
        return bool(self._call(P.DELETE, 0, (key.encode(),), "delete_key")[0])

    def _num_keys(self) -> int:
        return self._call(P.NUM_KEYS, 0, (), "num_keys")[0]

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        parts: list[bytes] = []
        for k, v in zip(keys, values):
            parts += (k.encode(), v)
        self._call(P.MULTI_SET, 0, parts, "multi_set")

    def _append(self, key: str, value: bytes) -> None:
        self._call(P.APPEND, 0, (key.encode(), value), "append")

    def _queue_push(self, key: str, value: bytes) -> None:
        self._call(P.QUEUE_PUSH, 0, (key.encode(), value), "queue_push")

    def _queue_pop(self, key: str, timeout: float | None) -> bytes:
        number = -1 if timeout is None else int(timeout * 1000)
        status, _, payload = self._request(P.QUEUE_POP, number, (key.encode(),), "queue_pop",
                                           (key,), timeout)
        if status == P.OK:
            return P.split(payload)[0]
        if status == P.EMPTY:
            raise QueueEmptyError(f"{self._where()}: queue_pop: queue {key!r} is empty")
        if status == P.TIMEOUT:
            raise StoreTimeoutError(f"{self._where()}: queue_pop: timeout: queue {key!r} "
                                    f"stayed empty for {timeout:g}s")
        message = P.split(payload)[0].decode("utf-8", "replace") if payload else "?"
        raise DistStoreError(f"{self._where()}: {message}")

    def _queue_len(self, key: str) -> int:
        return self._call(P.QUEUE_LEN, 0, (key.encode(),), "queue_len")[0]

    def wait_closed(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until the server closes this thread's
        connection; True if it did. A rank leaving a job uses it so that its next job on
        the same port cannot reach the old server."""
        sock = getattr(self._local, "sock", None)
        if sock is None or self._closed:
            return True
        sock.settimeout(timeout)
        try:
            closed = sock.recv(1) == b""
        except socket.timeout:
            closed = False
        except OSError:
            closed = True
        self._disconnect()
        return closed

    def ping(self) -> float:
        """Seconds for one round trip to the server (a liveness and latency probe)."""
        start = time.perf_counter()
        self._call(P.PING, 0, (), "ping")
        return time.perf_counter() - start
