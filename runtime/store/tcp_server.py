"""The TCPStore server: one thread, one ``selectors`` loop, every connection non-blocking.

A blocking ``get``/``wait`` never occupies the thread: it parks a waiter on the keys it
needs and a deadline in a timer heap, so one client waiting never delays another. The
server answers a timed-out wait itself, which keeps the client's connection usable.

Whatever a client sends, the server survives: a frame it cannot parse, a length over
its cap, an unknown command or a peer vanishing mid-frame drops that one connection with
a log line that says why. Keys live in the server, not in connections, so nothing is lost.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import os
import selectors
import socket
import threading
import time
from typing import Callable

from spmd.runtime.errors import DistStoreError
from spmd.runtime.store import protocol as P
from spmd.runtime.store.base import compare_set_result, parse_counter

__all__ = ["StoreServer"]

log = logging.getLogger("spmd.runtime.store")

_RECV_BYTES = 1 << 18  # read into one buffer of the server's: a fresh 256 KiB bytes object
# per recv() cost an mmap, an mremap and a munmap on every request (strace, 2026-11-26)
_HANDSHAKE_SECONDS = 30.0  # a connection that never finishes its greeting is dropped
_IOV_MAX = 512


class _Conn:
    __slots__ = ("sock", "peer", "rank", "inbuf", "out", "ready", "blocked", "closed", "nonce",
                 "waiter")

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.rank = -1
        self.inbuf = bytearray()
        self.out: collections.deque[memoryview] = collections.deque()
        self.ready = False  # handshake done
        self.blocked = False  # a get/wait is parked; later frames wait their turn
        self.closed = False
        self.nonce = b""
        self.waiter: _Waiter | None = None

    def who(self) -> str:
        return self.peer + (f" (rank {self.rank})" if self.rank >= 0 else "")


class _Waiter:
    __slots__ = ("conn", "cmd", "keys", "missing", "count", "done")

    def __init__(self, conn: _Conn, cmd: int, keys: list[bytes], count: int = 0) -> None:
        self.conn, self.cmd, self.keys, self.count = conn, cmd, keys, count
        self.missing: set[bytes] = set()
        self.done = False


class _Drop(Exception):
    """Drop the current connection; the message says why."""


def _advance(bufs: list, sent: int) -> list[memoryview]:
    """What is left of ``bufs`` after ``sent`` bytes went out."""
    rest = []
    for buf in bufs:
        n = len(buf)
        if sent >= n:
            sent -= n
            continue
        rest.append(memoryview(buf)[sent:] if sent else memoryview(buf))
        sent = 0
    return rest


class StoreServer:
    """The server behind a master ``TCPStore``, running in a daemon thread of its process.

    Args:
        host: the address to bind (use loopback or a private interface: anyone who can
            reach it can read and write keys unless a token is required).
        port: the port; 0 picks a free one, readable afterwards as ``.port``.
        auth_token: when set, clients must prove they hold it (HMAC challenge-response).
        max_message: the largest request accepted, in bytes.
    """

    def __init__(
        self, host: str, port: int, *, auth_token: bytes | None, max_message: int,
        listen_fd: int | None = None,
    ) -> None:
        self.host = host
        self._token = auth_token
        self._max = max_message
        self._listener = self._bind(host, port) if listen_fd is None else self._adopt(listen_fd)
        self.port: int = self._listener.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")

        self._data: dict[bytes, bytes] = {}
        self._queues: dict[bytes, collections.deque[bytes]] = {}  # only queues with items
        self._waiters: dict[bytes, list[_Waiter]] = {}
        self._worker_waiters: list[_Waiter] = []
        self._joined = 0
        self._timers: list[tuple[float, int, object]] = []
        self._seq = itertools.count()
        self._recv_view = memoryview(bytearray(_RECV_BYTES))
        self._resume: collections.deque[_Conn] = collections.deque()
        self._conns: set[_Conn] = set()
        self._stopping = False
        self._handlers: dict[int, Callable[[_Conn, int, list[bytes]], None]] = {
            P.SET: self._on_set, P.GET: self._on_get, P.ADD: self._on_add,
            P.COMPARE_SET: self._on_compare_set, P.WAIT: self._on_wait,
            P.CHECK: self._on_check, P.DELETE: self._on_delete, P.NUM_KEYS: self._on_num_keys,
            P.MULTI_SET: self._on_multi_set, P.APPEND: self._on_append, P.JOIN: self._on_join,
            P.WAIT_WORKERS: self._on_wait_workers, P.PING: self._on_ping,
            P.QUEUE_PUSH: self._on_queue_push, P.QUEUE_POP: self._on_queue_pop,
            P.QUEUE_LEN: self._on_queue_len,
        }
        self._thread = threading.Thread(
            target=self._run, name=f"spmd-store-server:{self.port}", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @staticmethod
    def _adopt(fd: int) -> socket.socket:
        """A socket the caller already bound and listens on (torch's ``master_listen_fd``:
        a launcher that reserved the port hands it over)."""
        try:
            sock = socket.socket(fileno=fd)
        except OSError as e:
            raise DistStoreError(f"TCPStore: master_listen_fd {fd} is not a socket: {e}") from e
        if sock.type != socket.SOCK_STREAM:
            raise DistStoreError(f"TCPStore: master_listen_fd {fd} is not a stream socket")
        try:
            sock.listen(4096)  # already listening: only raises the backlog
        except OSError as e:
            raise DistStoreError(f"TCPStore: master_listen_fd {fd} cannot listen: {e}") from e
        sock.setblocking(False)
        return sock

    @staticmethod
    def _bind(host: str, port: int) -> socket.socket:
        try:
            infos = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
        except socket.gaierror as e:
            raise DistStoreError(f"TCPStore: cannot resolve host {host!r} to bind: {e}") from e
        error: OSError | None = None
        for family, kind, proto, _, addr in infos:
            sock = socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(addr)
                sock.listen(4096)
                sock.setblocking(False)
                return sock
            except OSError as e:
                error = e
                sock.close()
        raise DistStoreError(f"The server socket has failed to listen on any local network "
                             f"address: TCPStore cannot listen on {host}:{port}: {error}"
                             ) from error

    # -- lifetime ---------------------------------------------------------------------

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop and close every connection. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while not self._stopping:
                for key, mask in self._sel.select(self._next_timeout()):
                    what = key.data
                    if what.__class__ is _Conn:
                        self._serve(what, mask)
                    elif what == "accept":
                        self._accept()
                    else:
                        self._drain_wake()
                self._expire()
                while self._resume:
                    conn = self._resume.popleft()
                    self._guarded(conn, self._process)
        except Exception:  # the loop itself failing is a bug; say so loudly
            log.exception("TCPStore server %s stopped by an internal error", self.address)
        finally:
            for conn in list(self._conns):
                self._close(conn)
            for s in (self._listener, self._wake_r, self._wake_w):
                s.close()
            self._sel.close()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    # -- connections ------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors, mostly: keep serving the rest
                log.warning("TCPStore server %s: accept failed: %s", self.address, e)
                return
            sock.setblocking(False)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr))
            self._conns.add(conn)
            self._sel.register(sock, selectors.EVENT_READ, conn)
            conn.nonce = os.urandom(P.NONCE_BYTES) if self._token else bytes(P.NONCE_BYTES)
            flags = P.FLAG_AUTH if self._token else 0
            hello = P.HELLO.pack(P.MAGIC, flags, self._max, conn.nonce)
            self._guarded(conn, lambda c: self._send(c, [hello]))
            self._timer(time.monotonic() + _HANDSHAKE_SECONDS, conn)

    def _serve(self, conn: _Conn, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._guarded(conn, self._flush)
        if mask & selectors.EVENT_READ and not conn.closed:
            self._guarded(conn, self._read)

    def _guarded(self, conn: _Conn, step: Callable[[_Conn], None]) -> None:
        if conn.closed:
            return
        try:
            step(conn)
        except _Drop as e:
            self._drop(conn, str(e))
        except Exception as e:  # a bug in a handler must not take the server down
            log.exception("TCPStore server %s: error serving %s", self.address, conn.who())
            self._drop(conn, f"internal error: {e!r}")

    def _drop(self, conn: _Conn, reason: str) -> None:
        log.warning(
            "TCPStore server %s: dropped connection from %s: %s", self.address, conn.who(), reason
        )
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._conns.discard(conn)
        if conn.waiter is not None:
            self._forget(conn.waiter)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _read(self, conn: _Conn) -> None:
        try:
            n = conn.sock.recv_into(self._recv_view)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            raise _Drop(f"receive failed: {e}") from None
        if not n:
            if conn.inbuf:
                raise _Drop(f"disconnected in the middle of a frame ({len(conn.inbuf)} bytes)")
            log.debug("TCPStore server %s: %s disconnected", self.address, conn.who())
            self._close(conn)
            return
        conn.inbuf += self._recv_view[:n]
        self._process(conn)

    def _process(self, conn: _Conn) -> None:
        """Run every complete frame in the connection's buffer, in order."""
        buf = conn.inbuf
        pos = 0
        while not conn.blocked and not conn.closed:
            if not conn.ready:
                used = self._handshake(conn, buf, pos)
                if not used:
                    break
                pos += used
                continue
            if len(buf) - pos < P.HEADER.size:
                break
            cmd, number, length = P.HEADER.unpack_from(buf, pos)
            handler = self._handlers.get(cmd)
            if handler is None:
                raise _Drop(f"unknown command {cmd}")
            if length > self._max:
                raise _Drop(
                    f"{P.COMMAND_NAMES[cmd]} frame of {length} bytes exceeds the "
                    f"{self._max}-byte cap (SPMD_STORE_MAX_MESSAGE)"
                )
            end = pos + P.HEADER.size + length
            if len(buf) < end:
                break
            try:
                parts = P.split(memoryview(buf)[pos + P.HEADER.size : end])
            except ValueError as e:
                raise _Drop(f"malformed {P.COMMAND_NAMES[cmd]} frame: {e}") from None
            pos = end
            handler(conn, number, parts)
        # Not in a finally: after a _Drop the connection is closed and its buffer moot.
        if pos and not conn.closed:
            del buf[:pos]

    def _handshake(self, conn: _Conn, buf: bytearray, pos: int) -> int:
        need = P.CLIENT_HELLO.size + (2 * P.NONCE_BYTES if self._token else 0)
        if len(buf) - pos < need:
            if buf[pos : pos + len(P.MAGIC)] != P.MAGIC[: len(buf) - pos]:
                raise _Drop("not an spmd store client (bad greeting)")
            return 0
        magic, rank = P.CLIENT_HELLO.unpack_from(buf, pos)
        if magic != P.MAGIC:
            raise _Drop("not an spmd store client (bad greeting)")
        conn.rank = rank
        reply = bytes(P.NONCE_BYTES)
        if self._token:
            at = pos + P.CLIENT_HELLO.size
            client_nonce = bytes(buf[at : at + P.NONCE_BYTES])
            proof = bytes(buf[at + P.NONCE_BYTES : at + 2 * P.NONCE_BYTES])
            expected = P.mac(self._token, b"client", conn.nonce, client_nonce)
            if not P.same(proof, expected):
                self._send(conn, [bytes([P.ACCEPT_REFUSED]) + reply])
                raise _Drop("refused: the client does not hold the auth token")
            reply = P.mac(self._token, b"server", client_nonce, conn.nonce)
        conn.ready = True
        self._send(conn, [bytes([P.ACCEPT_OK]) + reply])
        return need

    # -- sending ----------------------------------------------------------------------

    def _send(self, conn: _Conn, bufs: list) -> None:
        if conn.out:
            conn.out.extend(memoryview(b) for b in bufs)
            return
        try:
            sent = conn.sock.sendmsg(bufs[:_IOV_MAX])
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as e:
            raise _Drop(f"send failed: {e}") from None
        rest = _advance(bufs, sent)
        if rest:
            conn.out.extend(rest)
            self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)

    def _flush(self, conn: _Conn) -> None:
        if not conn.out:
            return
        bufs = list(itertools.islice(conn.out, _IOV_MAX))
        try:
            sent = conn.sock.sendmsg(bufs)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            raise _Drop(f"send failed: {e}") from None
        for _ in bufs:
            conn.out.popleft()
        conn.out.extendleft(reversed(_advance(bufs, sent)))
        if not conn.out:
            self._sel.modify(conn.sock, selectors.EVENT_READ, conn)

    def _reply(self, conn: _Conn, status: int, number: int = 0, parts: tuple | list = ()) -> None:
        self._send(conn, P.frame(status, number, parts))

    # -- waiting ----------------------------------------------------------------------

    def _timer(self, deadline: float, what: object) -> None:
        heapq.heappush(self._timers, (deadline, next(self._seq), what))

    def _next_timeout(self) -> float | None:
        timers = self._timers
        while timers:
            what = timers[0][2]
            if (isinstance(what, _Waiter) and what.done) or (
                isinstance(what, _Conn) and (what.ready or what.closed)
            ):
                heapq.heappop(timers)
                continue
            return max(0.0, timers[0][0] - time.monotonic())
        return None

    def _expire(self) -> None:
        now = time.monotonic()
        timers = self._timers
        while timers and timers[0][0] <= now:
            what = heapq.heappop(timers)[2]
            if isinstance(what, _Conn):
                if not what.ready and not what.closed:
                    self._drop(what, f"no greeting within {_HANDSHAKE_SECONDS:g}s")
            elif not what.done:
                self._forget(what)
                conn = what.conn
                self._guarded(conn, lambda c: self._reply(
                    c, P.TIMEOUT, self._joined, sorted(what.missing)
                ))
                self._unblock(conn)

    def _park(self, conn: _Conn, waiter: _Waiter, timeout_ms: int) -> None:
        conn.blocked = True
        conn.waiter = waiter
        for key in waiter.missing:
            self._waiters.setdefault(key, []).append(waiter)
        self._timer(time.monotonic() + max(timeout_ms, 0) / 1000.0, waiter)

    def _forget(self, waiter: _Waiter) -> None:
        waiter.done = True
        waiter.conn.waiter = None
        if waiter.cmd == P.WAIT_WORKERS:
            if waiter in self._worker_waiters:
                self._worker_waiters.remove(waiter)
            return
        for key in waiter.missing:
            lst = self._waiters.get(key)
            if lst is not None:
                try:
                    lst.remove(waiter)
                except ValueError:
                    pass
                if not lst:
                    del self._waiters[key]

    def _unblock(self, conn: _Conn) -> None:
        conn.blocked = False
        if not conn.closed and conn.inbuf:
            self._resume.append(conn)

    def _notify(self, key: bytes) -> None:
        waiters = self._waiters.pop(key, None)
        if not waiters:
            return
        for w in waiters:
            if w.done:
                continue
            w.missing.discard(key)
            if not w.missing:
                missing = self._missing(w.cmd, w.keys)  # deleted or popped meanwhile?
                if missing:
                    w.missing = missing
                    for k in missing:
                        self._waiters.setdefault(k, []).append(w)
                    continue
                w.done = True
                w.conn.waiter = None
                self._guarded(w.conn, lambda c: self._answer(c, w))
                self._unblock(w.conn)

    def _missing(self, cmd: int, keys: list[bytes]) -> set[bytes]:
        """The keys a GET, WAIT or QUEUE_POP still waits for: GET reads values; WAIT also
        takes a queue with items (as torch's); QUEUE_POP needs an item."""
        data = self._data
        if cmd == P.GET:
            return {k for k in keys if k not in data}
        queues = self._queues
        if cmd == P.QUEUE_POP:
            return {k for k in keys if k not in queues}
        return {k for k in keys if k not in data and k not in queues}

    def _answer(self, conn: _Conn, w: _Waiter) -> None:
        if w.cmd == P.GET:
            self._reply(conn, P.OK, 0, [self._data[k] for k in w.keys])
        elif w.cmd == P.QUEUE_POP:
            self._reply(conn, P.OK, 0, [self._pop(w.keys[0])])
        elif w.cmd == P.WAIT_WORKERS:
            self._reply(conn, P.OK, self._joined)
        else:
            self._reply(conn, P.OK)

    # -- commands ---------------------------------------------------------------------

    @staticmethod
    def _arity(parts: list[bytes], n: int, cmd: int) -> None:
        if len(parts) != n:
            raise _Drop(f"{P.COMMAND_NAMES[cmd]} takes {n} strings, got {len(parts)}")

    def _store(self, key: bytes, value: bytes) -> None:
        self._data[key] = value
        if key in self._waiters:
            self._notify(key)

    def _on_set(self, conn: _Conn, number: int, parts: list[bytes]) -> None:
        self._arity(parts, 2, P.SET)
        self._store(parts[0], parts[1])

    def _on_get(self, conn: _Conn, number: int, parts: list[bytes]) -> None:
        data = self._data
        missing = {k for k in parts if k not in data}
        if not missing:
            self._reply(conn, P.OK, 0, [data[k] for k in parts])
            return
        w = _Waiter(conn, P.GET, parts)
        w.missing = missing
        self._park(conn, w, number)

    def _on_wait(self, conn: _Conn, number: int, parts: list[bytes]) -> None:
        missing = self._missing(P.WAIT, parts)
        if not missing:
            self._reply(conn, P.OK)
            return
        w = _Waiter(conn, P.WAIT, parts)
        w.missing = missing
        self._park(conn, w, number)

    def _on_add(self, conn: _Conn, number: int, parts: list[bytes]) -> None:
        self._arity(parts, 1, P.ADD)
        key = parts[0]
        try:
            value = parse_counter(self._data.get(key), number, key.decode("utf-8", "replace"))
        except DistStoreError as e:
            self._reply(conn, P.ERROR, 0, [str(e).encode()])
            return
        self._store(key, value)
        self._reply(conn, P.OK, int(value))

    def _on_compare_set(self, conn: _Conn, number: int, parts: list[bytes]) -> None:
        self._arity(parts, 3, P.COMPARE_SET)
        key, expected, desired = parts
        result, store = compare_set_result(self._data.get(key), expected, desired)
        if store:
            self._store(key, desired)
        self._reply(conn, P.OK, 0, [result])

    def _on_check(self, conn: _Conn, number: int, parts: list[bytes]) -> None:
        self._reply(conn, P.OK, int(not self._missing(P.WAIT, parts)))

    def _on_delete(self, conn: _Conn, number: int, parts: list[bytes]) -> None:
        self._arity(parts, 1, P.DELETE)
        self._reply(conn, P.OK, int(self._data.pop(parts[0], None) is not None))

    def _on_num_keys(self, conn: _Conn, number: int, parts: list[bytes]) -> None:
        self._reply(conn, P.OK, len(self._data))

    def _on_multi_set(self, conn: _Conn, number: int, parts: list[bytes]) -> None:
        if len(parts) % 2:
            raise _Drop(f"multi_set takes key/value pairs, got {len(parts)} strings")
        for i in range(0, len(parts), 2):
            self._store(parts[i], parts[i + 1])

    def _on_append(self, conn: _Conn, number: int, parts: list[bytes]) -> None:
        self._arity(parts, 2, P.APPEND)
        key, value = parts
        self._store(key, self._data.get(key, b"") + value)

    def _on_join(self, conn: _Conn, number: int, parts: list[bytes]) -> None:
        self._joined += 1
        self._reply(conn, P.OK, self._joined)
        for w in [w for w in self._worker_waiters if self._joined >= w.count]:
            self._worker_waiters.remove(w)
            w.done = True
            w.conn.waiter = None
            self._guarded(w.conn, lambda c: self._answer(c, w))
            self._unblock(w.conn)

    def _on_wait_workers(self, conn: _Conn, number: int, parts: list[bytes]) -> None:
        self._arity(parts, 1, P.WAIT_WORKERS)
        try:
            count = int(parts[0])
        except ValueError:
            raise _Drop(f"wait_for_workers count {parts[0][:20]!r} is not an integer") from None
        if self._joined >= count:
            self._reply(conn, P.OK, self._joined)
            return
        w = _Waiter(conn, P.WAIT_WORKERS, [], count)
        self._worker_waiters.append(w)
        conn.blocked = True
        conn.waiter = w
        self._timer(time.monotonic() + max(number, 0) / 1000.0, w)

    def _on_ping(self, conn: _Conn, number: int, parts: list[bytes]) -> None:
        self._reply(conn, P.OK)

    def _pop(self, key: bytes) -> bytes:
        queue = self._queues[key]
        item = queue.popleft()
        if not queue:
            del self._queues[key]
        return item

    def _on_queue_push(self, conn: _Conn, number: int, parts: list[bytes]) -> None:
        self._arity(parts, 2, P.QUEUE_PUSH)
        key, value = parts
        self._queues.setdefault(key, collections.deque()).append(value)
        if key in self._waiters:
            self._notify(key)

    def _on_queue_pop(self, conn: _Conn, number: int, parts: list[bytes]) -> None:
        self._arity(parts, 1, P.QUEUE_POP)
        key = parts[0]
        if key in self._queues:
            self._reply(conn, P.OK, 0, [self._pop(key)])
        elif number < 0:
            self._reply(conn, P.EMPTY)
        else:
            w = _Waiter(conn, P.QUEUE_POP, parts)
            w.missing = {key}
            self._park(conn, w, number)

    def _on_queue_len(self, conn: _Conn, number: int, parts: list[bytes]) -> None:
        self._arity(parts, 1, P.QUEUE_LEN)
        self._reply(conn, P.OK, len(self._queues.get(parts[0], ())))
