"""TCPStore against a live server: bad input, concurrency, auth, limits, lifetime."""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from datetime import timedelta

import pytest

from spmd.runtime import DistStoreError, DistTimeoutError, TCPStore, spawn
from spmd.runtime.launch import free_port
from spmd.runtime.store import protocol as P

T = timedelta(seconds=10)


@pytest.fixture
def master():
    store = TCPStore("127.0.0.1", 0, None, True, T)
    yield store
    store.close()


def raw_client(port: int) -> socket.socket:
    """A socket past the greeting, ready to send hand-made frames."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    hello = _read(sock, P.HELLO.size)
    assert hello.startswith(P.MAGIC)
    sock.sendall(P.CLIENT_HELLO.pack(P.MAGIC, 7))
    assert _read(sock, 33)[0] == P.ACCEPT_OK
    return sock


def _read(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def until(condition, what: str, timeout: float = 60.0) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` if it does not in time."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.01)


def parked(master: TCPStore, key: str) -> int:
    """How many blocking gets/waits the server has parked on ``key``. No public call can
    tell a request parked on the server from one not sent yet, so this reads the server's
    own table of waiters."""
    return len(master._server._waiters.get(key.encode(), ()))


def closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


BAD_INPUTS = {
    "garbage greeting": lambda port: _garbage(port),
    "truncated frame then disconnect": lambda port: _send_and_close(
        port, P.HEADER.pack(P.SET, 0, 100) + b"\x00" * 10),
    "oversized length prefix": lambda port: _frame_expect_drop(
        port, P.HEADER.pack(P.SET, 0, 0xFFFFFFFF)),
    "unknown command": lambda port: _frame_expect_drop(port, P.HEADER.pack(99, 0, 0)),
    "lengths that do not add up": lambda port: _frame_expect_drop(
        port, P.HEADER.pack(P.SET, 0, 6) + struct.pack("<I", 50) + b"ab"),
    "wrong number of strings": lambda port: _frame_expect_drop(
        port, b"".join(P.frame(P.SET, 0, [b"only-key"]))),
    "odd multi_set": lambda port: _frame_expect_drop(
        port, b"".join(P.frame(P.MULTI_SET, 0, [b"k", b"v", b"k2"]))),
    "non-numeric worker count": lambda port: _frame_expect_drop(
        port, b"".join(P.frame(P.WAIT_WORKERS, 100, [b"many"]))),
    "abrupt disconnect mid-request": lambda port: _send_and_close(
        port, b"".join(P.frame(P.SET, 0, [b"k", b"v" * 1000]))[:500]),
    "reset mid-request": lambda port: _reset(port),
}


def _garbage(port):
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    _read(sock, P.HELLO.size)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert closed_by_server(sock)
    sock.close()


def _send_and_close(port, data):
    sock = raw_client(port)
    sock.sendall(data)
    sock.close()


def _frame_expect_drop(port, data):
    sock = raw_client(port)
    sock.sendall(data)
    assert closed_by_server(sock)
    sock.close()


def _reset(port):
    sock = raw_client(port)
    sock.sendall(P.HEADER.pack(P.SET, 0, 1000) + b"\x00" * 100)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # RST


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_server_survives_bad_input_and_keeps_keys(master, case, caplog):
    client = TCPStore("127.0.0.1", master.port, timeout=T)
    client.set("survivor", b"still here")
    with caplog.at_level(logging.WARNING, logger="spmd.runtime.store"):
        BAD_INPUTS[case](master.port)
        until(lambda: any("dropped connection" in r.getMessage() for r in caplog.records),
              "the server to log that it dropped the connection")
    # the server lives on: the old connection, a new one, and every key
    assert client.get("survivor") == b"still here"
    assert TCPStore("127.0.0.1", master.port, timeout=T).get("survivor") == b"still here"
    assert client.num_keys() == 1


def test_drop_log_names_peer_rank_and_reason(master, caplog):
    with caplog.at_level(logging.WARNING, logger="spmd.runtime.store"):
        _frame_expect_drop(master.port, P.HEADER.pack(42, 0, 0))
    text = caplog.text
    assert "unknown command 42" in text and "rank 7" in text and "127.0.0.1:" in text


def test_large_value_and_large_key_roundtrip(master):
    client = TCPStore("127.0.0.1", master.port, timeout=T)
    value = os.urandom(64 << 20)
    key = "k" * (64 << 10)
    client.set(key, value)
    assert master.get(key) == value
    assert client.compare_set(key, value, b"small") == b"small"


def test_oversized_value_rejected_client_side(monkeypatch):
    monkeypatch.setenv("SPMD_STORE_MAX_MESSAGE", "1000")
    master = TCPStore("127.0.0.1", 0, None, True, T)
    with pytest.raises(ValueError, match="exceeds the server's 1000-byte limit"):
        master.set("big", b"x" * 2000)
    master.set("fine", b"x" * 10)
    assert master.get("fine") == b"x" * 10
    master.close()


def test_blocked_get_never_delays_another_client(master):
    waiter = TCPStore("127.0.0.1", master.port, timeout=T)
    other = TCPStore("127.0.0.1", master.port, timeout=T)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("v", waiter.get("slow")))
    t.start()
    until(lambda: parked(master, "slow") == 1, "the get to be parked on the server")
    for i in range(100):  # each would time out (T) if the parked get held the server up
        other.set(f"k{i}", b"v")
        assert other.get(f"k{i}") == b"v"
    assert t.is_alive() and "v" not in result  # all answered while the get stayed blocked
    other.set("slow", b"done")
    t.join(5)
    assert result["v"] == b"done"


def test_many_waiters_on_one_key_all_wake(master):
    clients = [TCPStore("127.0.0.1", master.port, timeout=T) for _ in range(20)]
    out = []
    threads = [threading.Thread(target=lambda c=c: out.append(c.get("go"))) for c in clients]
    for t in threads:
        t.start()
    until(lambda: parked(master, "go") == 20, "all 20 gets to be parked on the server")
    assert out == []
    master.set("go", b"1")
    for t in threads:
        t.join(5)
    assert out == [b"1"] * 20


def _hold_connections(rank, port, n):
    stores = [TCPStore("127.0.0.1", port, timeout=timedelta(seconds=30)) for _ in range(n)]
    for i, s in enumerate(stores):
        s.add("connected", 1)
    stores[0].wait(["release"])
    return sum(int(s.get("connected")) > 0 for s in stores)


def test_256_simultaneous_connections_from_several_processes(master):
    ctx = spawn(_hold_connections, args=(master.port, 64), nprocs=4, join=False,
                start_method="forkserver", timeout=90)
    deadline = time.monotonic() + 60
    while int(master.get("connected") if master.check(["connected"]) else 0) < 256:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert master.set("release", b"1") is None
    assert ctx.join() == [64] * 4
    assert master.get("connected") == b"256"


def test_client_may_start_before_master():
    """The client starts first: its first try meets a port that hangs up (as one whose
    master is not up yet, or is going away, does), and it keeps trying until the master is
    up."""
    stand_in = socket.create_server(("127.0.0.1", 0))
    port = stand_in.getsockname()[1]
    out = {}

    def client():
        c = TCPStore("127.0.0.1", port, timeout=T)
        out["v"] = c.get("from-master")

    t = threading.Thread(target=client)
    t.start()
    stand_in.settimeout(10)
    conn, _ = stand_in.accept()  # the client's first try, before the master exists
    conn.close()
    stand_in.close()
    assert t.is_alive() and out == {}
    master = TCPStore("127.0.0.1", port, 2, True, T)  # waits for the client to join
    master.set("from-master", b"hi")
    t.join(5)
    assert out["v"] == b"hi"
    master.close()


def test_wait_for_workers_returns_when_all_joined():
    port = free_port()
    made = {}
    returned = threading.Event()

    def start_master():
        made["master"] = TCPStore("127.0.0.1", port, 3, True, T)
        returned.set()

    t = threading.Thread(target=start_master)
    t.start()
    first = TCPStore("127.0.0.1", port, timeout=T)  # retries until the master listens
    # 2 of 3 joined: the master must still be waiting (0.3 s for it to return wrongly)
    assert not returned.wait(0.3)
    second = TCPStore("127.0.0.1", port, timeout=T)
    assert returned.wait(10)
    t.join()
    for store in (first, second, made["master"]):
        store.close()


def test_wait_for_workers_times_out_naming_counts():
    port = free_port()
    with pytest.raises(DistTimeoutError, match="only 1 of 3 participants joined"):
        TCPStore("127.0.0.1", port, 3, True, timedelta(seconds=0.5))
    # the failed master released its port
    TCPStore("127.0.0.1", port, 1, True, T).close()


def test_port_in_use_is_a_clear_error(master):
    with pytest.raises(DistStoreError, match="cannot listen"):
        TCPStore("127.0.0.1", master.port, 1, True, T)


def test_connect_timeout_when_no_server():
    port = free_port()
    with pytest.raises(DistTimeoutError, match="could not connect within 0.5s"):
        TCPStore("127.0.0.1", port, timeout=timedelta(seconds=0.5))


def test_not_an_spmd_server_is_named():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    judged = threading.Event()

    def speak():
        conn, _ = listener.accept()
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b" " * 60)
        judged.wait(10)  # hang up only once the client has judged the greeting
        conn.close()

    threading.Thread(target=speak, daemon=True).start()
    with pytest.raises(DistStoreError, match="not an spmd TCPStore"):
        TCPStore("127.0.0.1", listener.getsockname()[1], timeout=T)
    judged.set()
    listener.close()


def test_server_gone_is_reported_not_hung(master):
    client = TCPStore("127.0.0.1", master.port, timeout=T)
    client.set("k", b"v")
    master.close()  # returns once the server has stopped and closed its connections
    with pytest.raises(DistStoreError, match="lost the connection to the server during get"):
        client.get("k")


def test_bad_constructor_arguments():
    with pytest.raises(ValueError):
        TCPStore("", 1)
    with pytest.raises(ValueError):
        TCPStore("127.0.0.1", 70000)
    with pytest.raises(ValueError, match="only valid on the master"):
        TCPStore("127.0.0.1", 0)
    with pytest.raises(ValueError):
        TCPStore("127.0.0.1", 1, world_size=0)
    with pytest.raises(TypeError):
        TCPStore("127.0.0.1", 1, is_master="yes")
    with pytest.raises(ValueError):
        TCPStore("127.0.0.1", 1, timeout=timedelta(seconds=-1))


def test_closed_store_says_so(master):
    client = TCPStore("127.0.0.1", master.port, timeout=T)
    client.close()
    with pytest.raises(DistStoreError, match="closed"):
        client.get("x")


# -- auth ------------------------------------------------------------------------------


class Recorder:
    """A TCP proxy that records every byte clients send, to prove what crosses the wire."""

    def __init__(self, target_port: int) -> None:
        self.sent = bytearray()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.port = self.listener.getsockname()[1]
        self.target = target_port
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pump, args=(conn, up, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, conn, False), daemon=True).start()

    def _pump(self, src, dst, record):
        try:
            while data := src.recv(65536):
                if record:
                    self.sent += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            dst.close()


def test_auth_token_accepted_and_never_on_the_wire():
    token = "s3cret-token-value"
    master = TCPStore("127.0.0.1", 0, None, True, T, auth_token=token)
    proxy = Recorder(master.port)
    client = TCPStore("127.0.0.1", proxy.port, timeout=T, auth_token=token)
    client.set("k", b"v")
    assert master.get("k") == b"v"
    assert client.get("k") == b"v"
    assert token.encode() not in proxy.sent
    master.close()


def test_auth_wrong_token_refused(caplog):
    master = TCPStore("127.0.0.1", 0, None, True, T, auth_token="right")
    with caplog.at_level(logging.WARNING, logger="spmd.runtime.store"):
        with pytest.raises(DistStoreError, match="refused this client: wrong auth token"):
            TCPStore("127.0.0.1", master.port, timeout=T, auth_token="wrong")
        deadline = time.monotonic() + 60
        while "does not hold the auth token" not in caplog.text:  # logged after the refusal
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.01)
    master.close()


def test_auth_missing_token_refused_with_advice():
    master = TCPStore("127.0.0.1", 0, None, True, T, auth_token="right")
    with pytest.raises(DistStoreError, match="requires an auth token.*SPMD_AUTH_TOKEN"):
        TCPStore("127.0.0.1", master.port, timeout=T)
    master.close()


def test_auth_token_from_environment(monkeypatch):
    monkeypatch.setenv("SPMD_AUTH_TOKEN", "from-env")
    master = TCPStore("127.0.0.1", 0, None, True, T)
    client = TCPStore("127.0.0.1", master.port, timeout=T)
    client.set("k", b"v")
    monkeypatch.delenv("SPMD_AUTH_TOKEN")
    with pytest.raises(DistStoreError, match="requires an auth token"):
        TCPStore("127.0.0.1", master.port, timeout=T)
    master.close()


def test_client_with_token_refuses_open_server():
    master = TCPStore("127.0.0.1", 0, None, True, T)
    with pytest.raises(DistStoreError, match="does not require one"):
        TCPStore("127.0.0.1", master.port, timeout=T, auth_token="t")
    master.close()


def test_unauthenticated_frames_are_never_run():
    master = TCPStore("127.0.0.1", 0, None, True, T, auth_token="right")
    sock = socket.create_connection(("127.0.0.1", master.port), timeout=5)
    _read(sock, P.HELLO.size)
    # skip the proof, go straight to a command
    sock.sendall(P.CLIENT_HELLO.pack(P.MAGIC, 0) + bytes(64)
                 + b"".join(P.frame(P.SET, 0, [b"intruder", b"1"])))
    assert _read(sock, 33)[0] == P.ACCEPT_REFUSED
    assert closed_by_server(sock)
    assert not master.check(["intruder"])
    master.close()


def test_multi_tenant_masters_share_one_server_until_the_last_closes():
    import socket

    from spmd.runtime import TCPStore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True)
    second = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True)
    first.set("k", b"v")
    assert second.get("k") == b"v"  # one server, two tenants
    first.close()
    second.set("still", b"served")  # the server outlives its first user
    client = TCPStore("127.0.0.1", port)
    assert client.get("still") == b"served"
    client.close()
    second.close()
    with pytest.raises(Exception):  # now it is gone
        TCPStore("127.0.0.1", port, timeout=__import__("datetime").timedelta(seconds=0.5))


def _queue_story(store) -> list:
    """What a program sees of a queue through check, wait, queue_len, delete_key and
    num_keys, as plain values to compare between two stores."""
    def outcome(fn):
        try:
            return ("ok", fn())
        except Exception as e:  # which error (torch's store errors are one class) and
            # whether it says "timeout", which torch's tests match
            return ("raised", type(e).__name__ == "QueueEmptyError", "timeout" in str(e))

    keys = store.num_keys()
    seen = [store.check(["q"]), store.queue_len("q")]
    store.queue_push("q", b"1")
    store.queue_push("q", b"2")
    seen += [store.check(["q"]), store.queue_len("q"), store.num_keys() - keys,
             outcome(lambda: store.wait(["q"], timedelta(seconds=2))),
             store.delete_key("q"), store.queue_len("q"),
             store.queue_pop("q"), store.check(["q"]), store.queue_pop("q"), store.check(["q"]),
             outcome(lambda: store.wait(["q"], timedelta(seconds=0.2))),
             outcome(lambda: store.queue_pop("q", block=False))]
    store.set("k", b"v")
    store.queue_push("k", b"item")
    seen += [store.get("k"), store.queue_len("k"), store.check(["k"])]
    return seen


def test_queue_is_seen_by_check_and_wait_as_in_torch_tcpstore(master):
    import torch.distributed as tdist

    theirs = tdist.TCPStore("127.0.0.1", 0, 1, True, timeout=T, wait_for_workers=False)
    expected = _queue_story(theirs)
    assert expected[2] is True  # this torch's TCPStore does count a queue for check
    assert _queue_story(master) == expected
