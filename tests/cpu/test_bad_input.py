"""Every kind of bad input raises a clear TypeError/ValueError/RuntimeError before any I/O.

A real one-rank Gloo group in this process is enough: the checks run before the backend
is called, which the last test proves by counting the group's sequence number.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from spmd import runtime as dist
from spmd.runtime import HashStore


@pytest.fixture
def world():
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=10))
    yield dist.get_process_group_ranks(None)
    dist.destroy_process_group()


T = torch.ones(4)
CASES = {
    "tensor not a tensor": (lambda: dist.all_reduce([1.0]), TypeError, "must be a torch.Tensor"),
    "bitwise op on floats": (lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND),
                             TypeError, "needs an integer or bool tensor"),
    "average of integers": (lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32),
                                                    op=dist.ReduceOp.AVG), TypeError,
                            "floating-point"),
    "unknown op": (lambda: dist.all_reduce(T, op="MEDIAN"), TypeError, "op must be a ReduceOp"),
    "dtype Gloo cannot move": (lambda: dist.all_reduce(torch.ones(2, dtype=torch.int16)),
                               TypeError, "Gloo cannot move torch.int16"),
    "sparse CSR tensor": (lambda: dist.all_reduce(torch.ones(2, 2).to_sparse_csr()),
                          TypeError, "only dense"),
    "sparse tensor, MAX": (lambda: dist.all_reduce(torch.ones(2).to_sparse(),
                                                   op=dist.ReduceOp.MAX),
                           ValueError, "takes ReduceOp.SUM or AVG, not MAX"),
    "sparse broadcast": (lambda: dist.broadcast(torch.ones(2).to_sparse(), src=0), TypeError,
                         "only dense"),
    "non-CPU tensor on Gloo": (lambda: dist.all_reduce(torch.empty(2, device="meta")),
                               ValueError, "uses Gloo, which takes CPU tensors"),
    "broadcast src outside group": (lambda: dist.broadcast(T, src=3), ValueError,
                                    "src 3 is not in process group"),
    "broadcast src not an int": (lambda: dist.broadcast(T, src="0"), TypeError,
                                 "must be an int"),
    "reduce dst outside group": (lambda: dist.reduce(T, dst=-1), ValueError, "dst -1"),
    "send to self": (lambda: dist.send(T, dst=0), ValueError, "cannot send to itself"),
    "recv from self": (lambda: dist.recv(T, src=0), ValueError, "cannot recv to itself"),
    "send non-contiguous": (lambda: dist.send(torch.ones(4, 4).t(), dst=0), ValueError,
                            "must be contiguous"),
    "negative tag": (lambda: dist.isend(T, dst=0, tag=-1), ValueError, "tag"),
    "all_gather list too short": (lambda: dist.all_gather([], T), ValueError,
                                  "has 0 tensors; process group 'default' has 1 ranks"),
    "all_gather list not a list": (lambda: dist.all_gather(T, T), TypeError,
                                   "must be a list of tensors"),
    "all_gather wrong shape": (lambda: dist.all_gather([torch.ones(3)], T), ValueError,
                               "has shape"),
    "all_gather wrong dtype": (lambda: dist.all_gather([torch.ones(4, dtype=torch.int64)], T),
                               TypeError, "is torch.int64 but the tensor is torch.float32"),
    "all_gather_into_tensor size": (lambda: dist.all_gather_into_tensor(torch.ones(5), T),
                                    ValueError, "needs 1 x 4 = 4"),
    "all_gather_into_tensor dtype": (
        lambda: dist.all_gather_into_tensor(torch.ones(4, dtype=torch.float64), T),
        TypeError, "output_tensor is torch.float64"),
    "reduce_scatter_tensor size": (lambda: dist.reduce_scatter_tensor(torch.ones(3), T),
                                   ValueError, "needs 1 x 3 = 3"),
    "reduce_scatter list length": (lambda: dist.reduce_scatter(T, [T, T]), ValueError,
                                   "has 2 tensors"),
    "gather without list on dst": (lambda: dist.gather(T, None, dst=0), ValueError,
                                   "must pass gather_list"),
    "scatter without list on src": (lambda: dist.scatter(T, None, src=0), ValueError,
                                    "must pass scatter_list"),
    "all_to_all_single splits sum": (
        lambda: dist.all_to_all_single(torch.ones(4), T, [3], [4]), ValueError, "sum to 3"),
    "all_to_all_single splits count": (
        lambda: dist.all_to_all_single(torch.ones(4), T, [2, 2], None), ValueError,
        "must be 1 non-negative ints"),
    "group of the wrong type": (lambda: dist.all_reduce(T, group="default"), TypeError,
                                "group must be a ProcessGroup"),
    "object list not a list": (lambda: dist.all_gather_object((None,), 1), TypeError,
                               "must be a list"),
    "P2POp with wrong op": (lambda: dist.P2POp(dist.all_reduce, T, 0), ValueError,
                            "must be spmd.runtime.isend or irecv"),
    "empty batch": (lambda: dist.batch_isend_irecv([]), ValueError, "non-empty list"),
    "new_group rank outside world": (lambda: dist.new_group([0, 5]), ValueError,
                                     "rank 5 is outside the world"),
    "new_group duplicate ranks": (lambda: dist.new_group([0, 0]), ValueError, "duplicates"),
    "new_group unknown backend": (lambda: dist.new_group([0], backend="carrier-pigeon"),
                                  ValueError, "unknown backend"),
    "monitored_barrier bad flag": (lambda: dist.monitored_barrier(wait_all_ranks="yes"),
                                   TypeError, "wait_all_ranks"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_rejected_before_anything_is_sent(world, case):
    call, exc, match = CASES[case]
    pg = dist.groups.world().default
    before = pg._seq
    with pytest.raises(exc, match=match):
        call()
    assert pg._seq == before, "the check ran after the collective was started"
    t = torch.ones(2)
    dist.all_reduce(t)  # the group is still healthy
    assert t.tolist() == [1.0, 1.0]


def test_everything_before_init_names_init_process_group():
    assert not dist.is_initialized()
    for call in (lambda: dist.all_reduce(T), lambda: dist.get_rank(), lambda: dist.barrier(),
                 lambda: dist.new_group([0]), lambda: dist.send(T, 1),
                 lambda: dist.destroy_process_group()):
        with pytest.raises(RuntimeError, match="init_process_group"):
            call()


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"backend": "smoke-signals"}, ValueError, "unknown backend"),
        ({"backend": "nccl"}, ValueError, "not available"),
        ({"backend": "mpi"}, ValueError, "not available"),
        ({"backend": 3}, TypeError, "backend must be a str"),
        ({"store": HashStore(), "init_method": "env://", "rank": 0, "world_size": 1},
         ValueError, "either store or init_method"),
        ({"store": HashStore(), "rank": 0}, ValueError, "world_size >= 1"),
        ({"store": HashStore(), "rank": 2, "world_size": 2}, ValueError, "rank in"),
        ({"store": {}, "rank": 0, "world_size": 1}, TypeError, "spmd.runtime Store"),
        ({"init_method": "tcp://127.0.0.1", "rank": 0, "world_size": 1}, ValueError,
         "needs a host and a port"),
        ({"timeout": -5, "store": HashStore(), "rank": 0, "world_size": 1}, ValueError,
         "positive"),
        ({"debug": 3, "store": HashStore(), "rank": 0, "world_size": 1}, TypeError, "debug"),
    ],
)
def test_bad_init_arguments(kwargs, exc, match):
    kwargs = {"backend": "gloo", **kwargs}
    with pytest.raises(exc, match=match):
        dist.init_process_group(**kwargs)
    assert not dist.is_initialized()
