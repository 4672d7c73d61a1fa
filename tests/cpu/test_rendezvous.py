"""rendezvous() by tcp://, file:// and env://, and every malformed input rejected up front."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest

from spmd.runtime import FileStore, TCPStore, rendezvous, spawn
from spmd.runtime.launch import free_port


def _meet(rank, url, world_size, pass_args):
    if pass_args:
        store, r, w = rendezvous(url, rank=rank, world_size=world_size,
                                 timeout=timedelta(seconds=30))
    else:
        store, r, w = rendezvous(url, timeout=timedelta(seconds=30))
    store.set(f"hello/{r}", f"from {r}")
    store.wait([f"hello/{i}" for i in range(w)])
    seen = [store.get(f"hello/{i}").decode() for i in range(w)]
    kind = type(store).__name__
    store.set(f"done/{r}", b"1")
    if r == 0:  # the master keeps serving until everyone has read
        store.wait([f"done/{i}" for i in range(w)])
    return r, w, seen, kind


def test_tcp_rendezvous_three_processes():
    port = free_port()
    out = spawn(_meet, args=(f"tcp://127.0.0.1:{port}", 3, True), nprocs=3,
                start_method="forkserver", timeout=60)
    for rank, (r, w, seen, kind) in enumerate(out):
        assert (r, w, kind) == (rank, 3, "TCPStore")
        assert seen == ["from 0", "from 1", "from 2"]


def test_tcp_rendezvous_rank_in_query_string():
    port = free_port()
    out = spawn(_meet_query, args=(port,), nprocs=2, start_method="forkserver", timeout=60)
    assert [o[:2] for o in out] == [(0, 2), (1, 2)]


def _meet_query(rank, port):
    return _meet(rank, f"tcp://127.0.0.1:{port}?rank={rank}&world_size=2", 2, False)


def test_file_rendezvous(tmp_path):
    url = f"file://{tmp_path}/rdzv"
    out = spawn(_meet, args=(url, 2, True), nprocs=2, start_method="forkserver", timeout=60)
    assert [o[3] for o in out] == ["FileStore", "FileStore"]
    assert out[0][2] == ["from 0", "from 1"]


def test_env_rendezvous_from_spawn_variables():
    out = spawn(_meet, args=("env://", 2, False), nprocs=2, start_method="forkserver",
                timeout=60)
    assert [o[:2] for o in out] == [(0, 2), (1, 2)]


def test_env_rendezvous_in_thread_ranks():
    out = spawn(_meet, args=("env://", 3, False), nprocs=3, start_method="thread", timeout=60)
    assert [o[:2] for o in out] == [(0, 3), (1, 3), (2, 3)]


def test_env_rendezvous_reads_slurm_variables(monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    store, rank, world = rendezvous("env://")
    assert (rank, world) == (0, 1) and isinstance(store, TCPStore)
    store.close()


def test_arguments_override_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "9")
    store, rank, world = rendezvous(f"file://{tmp_path}/f", rank=0, world_size=1)
    assert (rank, world) == (0, 1) and isinstance(store, FileStore)


@pytest.mark.parametrize(
    "url, kwargs, env, message",
    [
        ("nonsense", {}, {}, "unknown scheme"),
        ("http://127.0.0.1:80", {"rank": 0, "world_size": 1}, {}, "unknown scheme"),
        ("tcp://127.0.0.1", {"rank": 0, "world_size": 1}, {}, "needs a host and a port"),
        ("tcp://:{port}", {"rank": 0, "world_size": 1}, {}, "needs a host and a port"),
        ("tcp://127.0.0.1:notaport", {"rank": 0, "world_size": 1}, {}, "malformed port"),
        ("tcp://127.0.0.1:{port}", {"world_size": 2}, {}, "rank is missing"),
        ("tcp://127.0.0.1:{port}", {"rank": 0}, {}, "world_size is missing"),
        ("tcp://127.0.0.1:{port}", {"rank": 2, "world_size": 2}, {}, r"outside \[0, 2\)"),
        ("tcp://127.0.0.1:{port}", {"rank": -1, "world_size": 2}, {}, r"outside \[0, 2\)"),
        ("tcp://127.0.0.1:{port}", {"rank": 0, "world_size": 0}, {}, "must be positive"),
        ("tcp://127.0.0.1:{port}?rank=1", {"rank": 0, "world_size": 2}, {}, "rank is 0 from"),
        ("tcp://127.0.0.1:{port}?rank=0", {"rank": 0, "world_size": 1}, {},
         "has node-specific arguments"),
        ("tcp://127.0.0.1:{port}?rank=x&world_size=2", {}, {}, "must be an integer"),
        ("tcp://127.0.0.1:{port}?color=red", {"rank": 0, "world_size": 1}, {},
         "unknown parameter"),
        ("file://relative/path", {"rank": 0, "world_size": 1}, {}, "absolute path"),
        ("env://", {}, {"MASTER_PORT": "{port}", "RANK": "0", "WORLD_SIZE": "1"}, "MASTER_ADDR"),
        ("env://", {}, {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1"},
         "MASTER_PORT"),
        ("env://", {}, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{port}", "WORLD_SIZE": "1"},
         "RANK is not set"),
        ("env://", {}, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{port}", "RANK": "0"},
         "WORLD_SIZE is not set"),
        ("env://", {}, {"MASTER_ADDR": "h", "MASTER_PORT": "99999", "RANK": "0",
                        "WORLD_SIZE": "1"}, r"MASTER_PORT must be in \[1, 65535\]"),
        ("env://", {}, {"MASTER_ADDR": "h", "MASTER_PORT": "{port}", "RANK": "zero",
                        "WORLD_SIZE": "1"}, "RANK must be an integer"),
    ],
)
def test_bad_rendezvous_raises_value_error_before_connecting(monkeypatch, url, kwargs, env,
                                                             message):
    # The inputs name a port held here: serving on it would fail with another error, and a
    # connection to it would wait in the listener's queue.
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "SLURM_PROCID",
                "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v.format(port=port))
    with pytest.raises(ValueError, match=message):
        rendezvous(url.format(port=port), timeout=timedelta(seconds=30), **kwargs)
    listener.setblocking(False)
    with pytest.raises(BlockingIOError):  # no connection was tried
        listener.accept()
    listener.close()


def test_bad_types():
    with pytest.raises(TypeError):
        rendezvous(b"tcp://127.0.0.1:1")
    with pytest.raises(TypeError):
        rendezvous("tcp://127.0.0.1:1", rank="0", world_size=1)
