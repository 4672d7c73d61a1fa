"""Stores shared by real processes: exact counters, no lost keys, file clean-up."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest

from spmd.runtime import FileStore, TCPStore, spawn

T = timedelta(seconds=60)
ADDS = 200


def _hammer(rank, kind, where):
    store = (TCPStore("127.0.0.1", where, timeout=T, rank=rank) if kind == "tcp"
             else FileStore(where, timeout=T))
    seen = [store.add("counter", 1) for _ in range(ADDS)]
    store.set(f"done/{rank}", str(rank))
    for i in range(20):
        store.append("log", f"{rank}.{i};")
    store.compare_set("winner", b"", str(rank))
    return seen


@pytest.mark.parametrize("kind", ["tcp", "file"])
def test_concurrent_adds_are_exact_and_no_key_is_lost(kind, tmp_path):
    nprocs = 4
    if kind == "tcp":
        master = TCPStore("127.0.0.1", 0, None, True, T)
        where, reader = master.port, master
    else:
        where = str(tmp_path / "store")
        reader = FileStore(where, timeout=T)
    results = spawn(_hammer, args=(kind, where), nprocs=nprocs, start_method="forkserver",
                    timeout=100)
    assert reader.get("counter") == str(nprocs * ADDS).encode()
    every = sorted(v for seen in results for v in seen)
    assert every == list(range(1, nprocs * ADDS + 1))  # each add saw a distinct value
    assert all(reader.check([f"done/{r}"]) for r in range(nprocs))
    entries = reader.get("log").decode().strip(";").split(";")
    assert sorted(entries) == sorted(f"{r}.{i}" for r in range(nprocs) for i in range(20))
    assert int(reader.get("winner")) in range(nprocs)
    reader.close()


def _use_file_store(rank, path):
    store = FileStore(path, world_size=3, timeout=T)
    store.add("arrived", 1)
    store.wait(["go"])
    store.close()
    return os.path.exists(path)


def test_file_store_removed_when_last_user_closes(tmp_path):
    path = str(tmp_path / "shared")
    main = FileStore(path, world_size=3, timeout=T)
    ctx = spawn(_use_file_store, args=(path,), nprocs=2, join=False, start_method="forkserver",
                timeout=60)
    main.wait(["arrived"])
    while int(main.get("arrived")) < 2:
        pass
    main.set("go", b"1")
    ctx.join()
    assert os.path.exists(path)  # two of three closed
    main.close()
    assert not os.path.exists(path)


def test_file_store_without_world_size_keeps_file(tmp_path):
    path = str(tmp_path / "kept")
    store = FileStore(path)
    store.set("k", b"v")
    store.close()
    assert os.path.exists(path)
    again = FileStore(path)
    assert again.get("k") == b"v"


def test_file_store_compacts_without_losing_keys(tmp_path):
    path = str(tmp_path / "compact")
    a = FileStore(path, timeout=T)
    b = FileStore(path, timeout=T)
    b.set("early", b"e")
    value = b"x" * 4096
    for i in range(3000):  # ~12 MiB of overwrites of one key
        a.set("hot", value + str(i).encode())
    assert os.path.getsize(path) < 8 << 20  # compacted at least once
    assert b.get("hot") == value + b"2999"
    assert b.get("early") == b"e"
    assert b.num_keys() == 2


def test_file_store_rejects_foreign_file(tmp_path):
    path = tmp_path / "foreign"
    path.write_bytes(b"this is not a store file at all")
    from spmd.runtime import DistStoreError

    with pytest.raises(DistStoreError, match="not an spmd store file"):
        FileStore(str(path))
