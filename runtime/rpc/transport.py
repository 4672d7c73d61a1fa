"""The ZeroMQ layer: one ROUTER that receives everything, one DEALER per peer to send.

ZeroMQ sockets are not thread-safe, so each has one owner at a time:

- the I/O thread owns the ROUTER (receive, and the handshake replies) and the monitor
  sockets that report a peer's connection closing; it hands every authenticated message
  to ``on_message`` and runs ``on_tick`` for the agent's timers;
- a DEALER to a peer is shared by all sending threads under its lock (a socket may move
  between threads across a full memory barrier), and only ever sends after its
  handshake. Any thread sends without a hop through the I/O thread.

A peer whose connection closes without having said goodbye is reported to
``on_peer_lost``; a peer that refuses the connection is gone. See ``wire`` for the
handshake.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from typing import Any, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from spmd.runtime.context import RankContext, rank_context
from spmd.runtime.errors import DistError, DistTimeoutError
from spmd.runtime.rpc import wire

__all__ = ["Transport"]

log = logging.getLogger("spmd.runtime.rpc")
_CONNECT_MIN = 5.0  # seconds a first connection may take, whatever the call's timeout
_TICK = 0.05  # the I/O thread looks at its timers and new monitors at least this often
_MAX_PENDING_HANDSHAKES = 4096
_MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED


class _Link:
    __slots__ = ("peer", "lock", "sock", "reads_us", "lost")

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.lock = threading.Lock()
        self.sock: zmq.Socket | None = None
        self.reads_us = False  # the peer reads lent buffers from our memory
        self.lost: str | None = None


class Transport:
    """Sockets, the I/O thread and the handshake of one agent."""

    def __init__(self, *, rank: int, host: str, token: bytes | None,
                 describe: Callable[[int], str], grant_cma: Callable[[int], bool],
                 discover: Callable[[int], bool],
                 on_message: Callable[[int, bytes, list], None],
                 on_peer_lost: Callable[[int, str], None],
                 on_tick: Callable[[], float], rank_ctx: RankContext) -> None:
        self.rank = rank
        self.token = token
        self._describe = describe
        self._grant_cma = grant_cma
        self._discover = discover
        self._on_message = on_message
        self._on_peer_lost = on_peer_lost
        self._on_tick = on_tick
        self._rank_ctx = rank_ctx
        self.zctx = zmq.Context()
        self.router = self.zctx.socket(zmq.ROUTER)
        for opt, value in ((zmq.LINGER, 0), (zmq.ROUTER_MANDATORY, 1), (zmq.RCVHWM, 0),
                           (zmq.SNDHWM, 0)):
            self.router.setsockopt(opt, value)
        port = self.router.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.addresses: dict[int, str] = {}
        self._links: dict[int, _Link] = {}
        self._links_lock = threading.Lock()
        self._authed: dict[bytes, int] = {}  # identity -> peer rank (I/O thread only)
        self._hello: dict[bytes, tuple] = {}  # identity -> (peer, nonce_c, nonce_s)
        self._new_monitors: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"spmd-rpc-io-{rank}",
                                        daemon=True)

    def start(self, addresses: dict[int, str]) -> None:
        self.addresses = dict(addresses)
        self._thread.start()

    # -- sending (any thread) ------------------------------------------------------------

    def link(self, peer: int) -> _Link:
        link = self._links.get(peer)
        if link is None:
            with self._links_lock:
                link = self._links.setdefault(peer, _Link(peer))
        return link

    def send(self, peer: int, frames: list, deadline: float,
             build: Callable[[_Link], list] | None = None) -> _Link:
        """Send ``frames`` (or ``build(link)``'s, once connected) to ``peer``, connecting
        first if needed; DistError naming the peer when it is gone or unreachable."""
        link = self.link(peer)
        if link.lost:
            raise DistError(f"{self._describe(peer)} is gone ({link.lost})")
        if not link.lock.acquire(False) and not link.lock.acquire(
                timeout=max(deadline - time.monotonic(), 0.0)):
            raise DistTimeoutError(f"sending to {self._describe(peer)}: the connection was busy "
                                   f"connecting past the timeout")
        try:
            if link.sock is None:
                self._connect(link, deadline)
            if build is not None:
                frames = build(link)
            if len(frames) == 1:
                link.sock.send(frames[0])  # SNDHWM 0: never blocks
            else:
                link.sock.send_multipart(frames, copy=False)  # large frames: no copy
        finally:
            link.lock.release()
        return link

    def ensure(self, peer: int, deadline: float) -> None:
        """Connect to ``peer`` now (so its connection is watched) if not yet connected."""
        link = self.link(peer)
        if link.sock is not None:
            return
        if link.lost:
            raise DistError(f"{self._describe(peer)} is gone ({link.lost})")
        if not link.lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            raise DistTimeoutError(f"connecting to {self._describe(peer)}: timeout (another "
                                   f"thread was still connecting)")
        try:
            if link.sock is None:
                self._connect(link, deadline)
        finally:
            link.lock.release()

    def _connect(self, link: _Link, deadline: float) -> None:
        # A connection is set up once, on first use, and outlives the call that opens it:
        # a call with a tiny timeout (torch's tests set 1 ms) times out itself, but the
        # handshake gets at least _CONNECT_MIN, as torch's connect-at-init does
        deadline = max(deadline, time.monotonic() + _CONNECT_MIN)
        peer, address = link.peer, self.addresses[link.peer]
        sock = self.zctx.socket(zmq.DEALER)
        for opt, value in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0),
                           (zmq.ROUTING_ID, b"\x01" + secrets.token_bytes(15))):
            sock.setsockopt(opt, value)
        monitor = sock.get_monitor_socket(_MONITORED)
        try:
            sock.connect(address)
            reads_us = self._handshake(sock, monitor, peer, address, deadline)
        except BaseException:
            sock.close(0)
            monitor.close(0)
            raise
        link.sock, link.reads_us = sock, reads_us
        self._new_monitors.put((monitor, link))

    def _handshake(self, sock: zmq.Socket, monitor: zmq.Socket, peer: int, address: str,
                   deadline: float) -> bool:
        who = f"{self._describe(peer)} at {address}"
        nonce_c = secrets.token_bytes(wire.NONCE_BYTES)
        sock.send_multipart([b"HELLO", wire.MAGIC, wire.RANK.pack(self.rank), nonce_c])
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        reads_us = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DistTimeoutError(f"could not reach {who}: no handshake within the timeout")
            ready = dict(poller.poll(min(left, 1.0) * 1000))
            if monitor in ready:
                event = recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_CONNECT_RETRIED:
                    raise DistError(f"{who} is gone: it refused the connection")
                if event == zmq.EVENT_DISCONNECTED:
                    raise DistError(f"{who} is gone: it closed the connection")
            if sock not in ready:
                continue
            frames = sock.recv_multipart()
            if reads_us is None:
                if len(frames) != 5 or frames[0] != b"CHAL" or len(frames[1]) != wire.CHAL.size:
                    raise DistError(f"{who} answered the handshake with garbage")
                flags, server_rank, cma = wire.CHAL.unpack(frames[1])
                nonce_s, proof = frames[2], frames[3]
                if server_rank != peer:
                    raise DistError(f"{who} is rank {server_rank}, not rank {peer}")
                if flags & 1 and self.token is None:
                    raise DistError(f"{who} requires an auth token; set SPMD_AUTH_TOKEN")
                if self.token is not None:
                    if not flags & 1:
                        raise DistError(f"{who} does not ask for the auth token this worker "
                                        f"holds; refusing to talk to it")
                    if not wire.same(proof, wire.server_proof(self.token, nonce_c, nonce_s)):
                        raise DistError(f"{who} failed authentication: the auth tokens differ")
                    answer = wire.client_proof(self.token, nonce_s, nonce_c)
                else:
                    answer = b""
                sock.send_multipart([b"AUTH", answer])
                reads_us = bool(cma)
            elif frames and frames[0] == b"OK":
                return reads_us
            else:
                reason = frames[1].decode(errors="replace") if len(frames) > 1 else "refused"
                raise DistError(f"{who} refused this worker: {reason}")

    # -- the I/O thread ------------------------------------------------------------------

    def _run(self) -> None:
        with rank_context(self._rank_ctx):
            poller = zmq.Poller()
            poller.register(self.router, zmq.POLLIN)
            monitors: dict[zmq.Socket, _Link] = {}
            router = self.router
            next_tick = 0.0
            try:
                while not self._stop.is_set():
                    # the hot path is poll -> drain -> poll: anything else only when due,
                    # so the thread a message was handed to gets the GIL at once
                    now = time.monotonic()
                    if now >= next_tick:
                        while not self._new_monitors.empty():
                            monitor, link = self._new_monitors.get()
                            monitors[monitor] = link
                            poller.register(monitor, zmq.POLLIN)
                        try:
                            wait = min(_TICK, max(self._on_tick(), 0.0))
                        except Exception:
                            log.exception("rpc agent timer failed")
                            wait = _TICK
                        next_tick = now + wait
                    try:
                        ready = poller.poll(max(next_tick - now, 0.0) * 1000)
                        for sock, _ in ready:
                            if sock is router:
                                self._drain()
                            else:
                                self._monitor_event(sock, monitors[sock])
                    except zmq.ContextTerminated:
                        raise
                    except Exception:  # never let one bad moment stop the receiving
                        if self._stop.is_set():
                            break
                        log.exception("rpc: the I/O thread recovered from an error")
            except zmq.ContextTerminated:
                pass
            finally:
                for monitor in monitors:
                    monitor.close(0)
                while not self._new_monitors.empty():
                    self._new_monitors.get()[0].close(0)
                self.router.close(0)

    def _drain(self) -> None:
        router = self.router
        for _ in range(256):  # then look at the timers again
            try:
                ident = router.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            # frame 1 is small by protocol (a header, or a packed small message): bytes are
            # cheaper than a Frame; tensor frames after it stay zero-copy
            first = router.recv() if router.getsockopt(zmq.RCVMORE) else b""
            rest = []
            while router.getsockopt(zmq.RCVMORE):
                rest.append(router.recv(copy=False))
            try:
                peer = self._authed.get(ident)
                if peer is not None and first:
                    self._on_message(peer, first, rest)
                else:
                    self._handshake_step(ident, [first, *(f.bytes for f in rest)])
            except Exception:
                log.exception("rpc: dropped a message that could not be handled")
            if not router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return  # cheaper than the exception of an empty recv

    def _reply(self, ident: bytes, frames: list) -> None:
        try:
            self.router.send_multipart([ident, *frames])
        except zmq.ZMQError as e:
            log.warning("rpc: could not answer a handshake (%s)", e)

    def _handshake_step(self, ident: bytes, parts: list[bytes]) -> None:
        tag = parts[0] if parts else b""
        if tag == b"HELLO" and len(parts) == 4 and parts[1] == wire.MAGIC \
                and len(parts[2]) == wire.RANK.size and len(parts[3]) == wire.NONCE_BYTES:
            (peer,) = wire.RANK.unpack(parts[2])
            # a dynamic group reads its members first: the rank may be a new worker's
            if not self._discover(peer) and peer not in self.addresses:
                log.warning("rpc: refused a connection claiming to be unknown rank %d", peer)
                self._reply(ident, [b"NO", f"unknown rank {peer}".encode()])
                return
            if len(self._hello) >= _MAX_PENDING_HANDSHAKES:
                self._hello.pop(next(iter(self._hello)))
            nonce_s = secrets.token_bytes(wire.NONCE_BYTES)
            token = self.token
            proof = wire.server_proof(token, parts[3], nonce_s) if token else b""
            cma = 1 if self._grant_cma(peer) else 0
            self._hello[ident] = (peer, parts[3], nonce_s)
            self._reply(ident, [b"CHAL", wire.CHAL.pack(1 if token else 0, self.rank, cma),
                                nonce_s, proof, b""])
        elif tag == b"AUTH" and len(parts) == 2 and ident in self._hello:
            peer, nonce_c, nonce_s = self._hello.pop(ident)
            if self.token is None or wire.same(parts[1], wire.client_proof(self.token, nonce_s,
                                                                           nonce_c)):
                self._authed[ident] = peer
                self._reply(ident, [b"OK"])
            else:
                log.warning("rpc: a connection claiming to be rank %d failed authentication "
                            "(wrong auth token); dropped", peer)
                self._reply(ident, [b"NO", b"authentication failed"])
        else:
            log.warning("rpc: dropped a %d-frame message from an unauthenticated connection "
                        "(starts with %r)", len(parts), tag[:16])

    def _monitor_event(self, monitor: zmq.Socket, link: _Link) -> None:
        try:
            event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
        except zmq.Again:
            return
        except Exception:
            log.exception("rpc: unreadable monitor event")
            return
        if self._links.get(link.peer) is not link:
            return  # a worker that left a dynamic group (its rank may be back, anew)
        if event == zmq.EVENT_DISCONNECTED and link.lost is None:
            link.lost = "its connection closed"
            self._on_peer_lost(link.peer, link.lost)
        elif event == zmq.EVENT_CONNECT_RETRIED and link.lost is None:
            link.lost = "it refused a reconnection"
            self._on_peer_lost(link.peer, link.lost)

    def forget(self, peer: int) -> None:
        """``peer`` left (a dynamic group): a later worker with its rank connects anew."""
        self.addresses.pop(peer, None)
        with self._links_lock:
            self._links.pop(peer, None)

    # -- teardown ------------------------------------------------------------------------

    def close(self, linger: float) -> None:
        """Stop the I/O thread and close every socket; queued messages get ``linger`` s."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        for link in list(self._links.values()):
            if link.lock.acquire(timeout=2.0):
                try:
                    if link.sock is not None:
                        link.sock.close(int(linger * 1000))
                        link.sock = None
                finally:
                    link.lock.release()
        try:
            self.zctx.destroy(linger=0)
        except zmq.ZMQError:
            pass

    def links(self) -> list[Any]:
        return list(self._links.values())
