"""Stores as torch's tests use them: a ``Store`` subclassed in Python by overriding the
public methods (as ``torch.distributed.Store`` is), and a master ``TCPStore`` serving on
a socket the caller already listens on (``master_listen_fd``)."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch

from spmd import runtime as dist
from spmd.runtime import PrefixStore, Store, TCPStore


class DictStore(Store):
    """A store written the way torch's test_store.py writes its Python store."""

    def __init__(self) -> None:
        super().__init__(timedelta(seconds=5))
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.calls: list[str] = []

    def set(self, key, value):
        self.calls.append("set")
        with self.lock:
            self.data[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key):
        self.calls.append("get")
        for _ in range(1000):
            with self.lock:
                if key in self.data:
                    return self.data[key]
            time.sleep(0.005)
        raise TimeoutError(key)

    def add(self, key, value):
        with self.lock:
            new = int(self.data.get(key, b"0")) + value
            self.data[key] = str(new).encode()
            return new

    def compare_set(self, key, expected, desired):
        with self.lock:
            current = self.data.get(key)
            if current == expected or (current is None and expected == b""):
                self.data[key] = desired
                return desired
            return current if current is not None else expected

    def check(self, keys):
        with self.lock:
            return all(k in self.data for k in keys)

    def delete_key(self, key):
        with self.lock:
            return self.data.pop(key, None) is not None

    def num_keys(self):
        with self.lock:
            return len(self.data)


def test_a_python_store_gets_the_whole_api_from_its_overrides():
    store = DictStore()
    store.set("a", b"1")
    assert store.multi_get(["a"]) == [b"1"] and "get" in store.calls
    store.multi_set(["b", "c"], [b"2", b"3"])
    assert store.get("c") == b"3"
    store.append("log", b"x")
    store.append("log", b"y")
    assert store.get("log") == b"xy"
    store.queue_push("q", b"first")
    assert store.queue_len("q") == 1 and store.queue_pop("q") == b"first"
    store.wait(["a", "b"])  # by polling check()
    with pytest.raises(dist.DistTimeoutError):
        store.wait(["never"], timedelta(seconds=0.05))
    prefixed = PrefixStore("job", store)
    prefixed.set("k", b"v")
    assert store.check(["job/k"]) and prefixed.get("k") == b"v"
    assert store.delete_key("a") and not store.check(["a"])


def test_a_python_store_runs_a_process_group():
    dist.init_process_group("gloo", store=DictStore(), rank=0, world_size=1)
    try:
        t = torch.ones(3)
        dist.all_reduce(t)
        assert torch.equal(t, torch.ones(3))
    finally:
        dist.destroy_process_group()


def test_a_store_that_implements_nothing_names_what_to_override():
    class Empty(Store):
        pass

    with pytest.raises(NotImplementedError, match=r"does not implement set\(\)"):
        Empty().set("k", b"v")


def test_master_listen_fd_serves_on_the_given_socket():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    master = TCPStore("127.0.0.1", port, world_size=2, is_master=True, wait_for_workers=False,
                      master_listen_fd=listener.detach())
    client = TCPStore("127.0.0.1", port, world_size=2, timeout=timedelta(seconds=10))
    try:
        client.set("hello", b"world")
        assert master.get("hello") == b"world" and master.port == port
    finally:
        client.close()
        master.close()
    with pytest.raises(ValueError, match="master_listen_fd"):
        TCPStore("127.0.0.1", port, master_listen_fd=3)  # not the master
