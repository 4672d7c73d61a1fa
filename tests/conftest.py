"""Shared fixtures: stores of every kind, each live (TCP ones over real sockets)."""

from __future__ import annotations

import multiprocessing
import os
from datetime import timedelta

import pytest

from spmd.runtime import FileStore, HashStore, PrefixStore, TCPStore

STORE_KINDS = ["hash", "file", "tcp", "prefix"]

# Ranks started with start_method="forkserver" fork from a server that has torch imported
# already: a rank starts in milliseconds instead of re-importing torch.
multiprocessing.set_forkserver_preload(["torch", "spmd.runtime.collectives", "spmd.runtime.rpc"])
os.environ.setdefault("SPMD_HEARTBEAT_INTERVAL", "0.2")
# every graph planned in a test is verified: placements re-derived, gradients reduced,
# each sharding decision checked on real shards (spmd.lowering.verify)
os.environ.setdefault("SPMD_VERIFY", "1")


def make_store(kind: str, tmp_path, timeout: float = 5.0):
    """A store of ``kind`` and the objects that keep it alive (master, base store)."""
    t = timedelta(seconds=timeout)
    if kind == "hash":
        store = HashStore(t)
        return store, [store]
    if kind == "file":
        store = FileStore(os.path.join(tmp_path, "store"), timeout=t)
        return store, [store]
    if kind == "tcp":
        master = TCPStore("127.0.0.1", 0, 2, True, t, wait_for_workers=False)
        client = TCPStore("127.0.0.1", master.port, 2, False, t)
        return client, [client, master]
    if kind == "prefix":
        master = TCPStore("127.0.0.1", 0, 1, True, t)
        return PrefixStore("ns", master), [master]
    raise ValueError(kind)


@pytest.fixture(params=STORE_KINDS)
def store(request, tmp_path):
    store, keep = make_store(request.param, tmp_path)
    yield store
    for s in keep:
        s.close()


def pytest_collection_modifyitems(config, items):
    """``make test`` leaves the long profile (``tests/tiers.py``) out unless
    ``SPMD_TESTS=all``; ``SPMD_TESTS=fast`` (``make test-fast``) keeps only ``FAST``."""
    from tests.tiers import is_fast, is_long

    tier = os.environ.get("SPMD_TESTS", "ci")
    if tier not in ("ci", "all", "fast"):
        raise pytest.UsageError(f"SPMD_TESTS must be 'ci', 'fast' or 'all', got {tier!r}")
    if tier == "all":
        return
    chosen = is_fast if tier == "fast" else (lambda nodeid: not is_long(nodeid))
    keep, drop = [], []
    for item in items:
        (keep if chosen(item.nodeid) else drop).append(item)
    if drop:
        items[:] = keep
        config.hook.pytest_deselected(items=drop)
