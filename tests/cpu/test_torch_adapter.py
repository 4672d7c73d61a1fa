"""Our stores handed to PyTorch's c10d backends: a real Gloo all-reduce over them."""

from __future__ import annotations

from datetime import timedelta

import pytest

from spmd.runtime import DistTimeoutError, HashStore, rendezvous, spawn, to_torch_store


def _gloo_allreduce(rank, url):
    import torch
    import torch.distributed as tdist

    store, rank, world = rendezvous(url, timeout=timedelta(seconds=60))
    pg = tdist.ProcessGroupGloo(to_torch_store(store), rank, world, timedelta(seconds=60))
    t = torch.arange(4, dtype=torch.float32) * (rank + 1)
    pg.allreduce([t]).wait()
    pg.barrier().wait()
    return t


@pytest.mark.parametrize("scheme", ["env", "file"])
def test_gloo_allreduce_between_two_processes_over_our_store(scheme, tmp_path):
    import torch

    url = "env://" if scheme == "env" else f"file://{tmp_path}/gloo?world_size=2"
    if scheme == "file":
        out = spawn(_gloo_file, args=(url,), nprocs=2, timeout=100)
    else:
        out = spawn(_gloo_allreduce, args=(url,), nprocs=2, timeout=100)
    expected = torch.arange(4, dtype=torch.float32) * 3
    for t in out:
        assert torch.equal(t, expected)


def _gloo_file(rank, url):
    return _gloo_allreduce(rank, f"{url}&rank={rank}")


def test_adapter_methods_reach_our_store():
    import torch.distributed as tdist

    ours = HashStore(timedelta(seconds=1))
    theirs = to_torch_store(ours)
    assert isinstance(theirs, tdist.Store)
    theirs.set("k", "v")
    assert ours.get("k") == b"v"
    assert theirs.get("k") == b"v"
    assert theirs.add("n", 2) == 2
    assert theirs.compare_set("k", "v", "w") == b"w"
    assert theirs.check(["k"]) and theirs.num_keys() == 2
    assert theirs.delete_key("n")
    with pytest.raises(DistTimeoutError, match="missing"):
        theirs.wait(["missing"], timedelta(seconds=0.1))
    with pytest.raises(TypeError):
        to_torch_store(object())
