"""RRefs on real worker processes: values, proxies, and the owner's reference counting.

The lifetime tests count the values alive on the owner (a WeakSet of the objects) and
its registered forks while references move between three workers.
"""

from __future__ import annotations

import gc
import os
import time
import weakref

import torch

from spmd.runtime import spawn
from spmd.runtime.rpc import functions

OPTS = dict(rpc_timeout=20.0, num_worker_threads=4)


def _init(rank: int, world: int):
    from spmd.runtime import rpc

    os.environ["SPMD_RPC_RETRY_INTERVAL"] = "0.2"
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world,
                 rpc_backend_options=rpc.RpcBackendOptions(**OPTS))
    return rpc


class _Value:
    alive: "weakref.WeakSet[_Value]" = weakref.WeakSet()

    def __init__(self, tag):
        self.tag = tag
        _Value.alive.add(self)

    def __reduce__(self):
        return (_Value, (self.tag,))


def _make_value(tag):
    return _Value(tag)


def _owner_state():
    """(records kept for other workers, forks registered, values alive) on this worker."""
    from spmd.runtime.rpc.api import current_agent

    gc.collect()
    rc = current_agent("test").rrefs
    return len(rc.owners), sum(len(r.forks) for r in list(rc.owners.values())), \
        len(_Value.alive)


def _fork_makers():
    """Who made each fork the owner has registered: a fork's id is (its maker's rank, n)."""
    from spmd.runtime.rpc.api import current_agent

    rc = current_agent("test").rrefs
    return sorted(fork[0] for r in list(rc.owners.values()) for fork in r.forks)


def _until(check, want, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


_kept: list = []


def _keep(obj):
    _kept.append(obj)
    return len(_kept)


def _drop_all():
    _kept.clear()
    gc.collect()
    return True


def _pass_on(to):
    from spmd.runtime import rpc

    rpc.rpc_sync(to, _keep, args=({"nested": [_kept[-1]["nested"][0]]},))
    _kept.clear()
    gc.collect()
    return True


def _make_owned(tag):
    from spmd.runtime import rpc

    return [rpc.RRef(_Value(tag))]  # an owner RRef, forked to the caller in the answer


def _lifetime_rank(rank):
    rpc = _init(rank, 3)
    steps = {}
    if rank == 1:
        state = lambda: rpc.rpc_sync("w0", _owner_state)  # noqa: E731
        rref = rpc.remote("w0", _make_value, args=("a",))
        rref._get_future().wait()
        steps["created"] = state()
        rpc.rpc_sync("w2", _keep, args=({"nested": [rref]},))  # user -> user fork
        del rref
        gc.collect()
        steps["w1 dropped, w2 holds"] = _until(state, (1, 1, 1))
        rpc.rpc_sync("w2", _pass_on, args=("w1",))  # w2 -> w1, then w2 drops its fork
        steps["back on w1"] = _until(state, (1, 1, 1))
        _kept.clear()
        gc.collect()
        steps["all dropped"] = _until(state, (0, 0, 0))
        owned = rpc.rpc_sync("w0", _make_owned, args=("b",))  # owner -> user fork
        steps["owner forked"] = state()
        rpc.rpc_sync("w2", _keep, args=(owned,))
        del owned
        gc.collect()
        # Settled: the fork w1 made for w2 is registered and the owner's fork of w1 is gone.
        steps["hand-over"] = _until(lambda: rpc.rpc_sync("w0", _fork_makers), [1])
        steps["w2 holds the owner's"] = state()
        rpc.rpc_sync("w2", _drop_all)
        steps["end"] = _until(state, (0, 0, 0))
        steps["in flight"] = rpc.debug_info()["pending_children"]
    rpc.shutdown(timeout=30)
    return steps


def test_owner_deletes_a_value_only_after_every_fork_is_gone():
    steps = spawn(_lifetime_rank, nprocs=3, start_method="forkserver", timeout=90)[1]
    assert steps["created"] == (1, 1, 1)
    assert steps["w1 dropped, w2 holds"] == (1, 1, 1)
    assert steps["back on w1"] == (1, 1, 1)
    assert steps["all dropped"] == (0, 0, 0)
    assert steps["owner forked"] == (1, 1, 1)
    assert steps["hand-over"] == [1]
    assert steps["w2 holds the owner's"] == (1, 1, 1)
    assert steps["end"] == (0, 0, 0)
    assert steps["in flight"] == 0


def _keep_confirmed(obj):
    """Keep ``obj``; whether the RRef in it was confirmed by its owner when this ran."""
    _keep(obj)
    return obj["nested"][0].confirmed_by_owner()


def _faulty_rank(rank):
    from spmd.runtime.rpc import faults

    rpc = _init(rank, 3)
    out = {}
    rpc.rpc_sync("w0", torch.zeros, args=(1,))  # everyone is up before faults start
    if rank == 1:
        faults.inject(drop={"RREF_DELETE": 1})
        # w2's faults, in place when the call returns: before w2 is sent the RRef
        rpc.rpc_sync("w2", faults.inject,
                     kwargs=dict(delay={"RREF_FORK": 1.0}, drop={"RREF_ACCEPT": 1}))
        state = lambda: rpc.rpc_sync("w0", _owner_state)  # noqa: E731
        rref = rpc.remote("w0", _make_value, args=("c",))
        rref._get_future().wait()
        # as torch: the call runs once the owner registered the fork it carries (1 s late)
        out["confirmed when the call ran"] = rpc.rpc_sync("w2", _keep_confirmed,
                                                          args=({"nested": [rref]},))
        del rref
        gc.collect()
        samples = []
        for _ in range(8):  # the owner must keep the value all along
            samples.append(state()[2])
            time.sleep(0.1)
        out["while in flight"] = samples
        out["w2 registered"] = _until(state, (1, 1, 1))
        out["pending children"] = _until(lambda: rpc.debug_info()["pending_children"], 0)
        rpc.rpc_sync("w2", _drop_all)
        out["end"] = _until(state, (0, 0, 0))
        out["w1 dropped"] = faults.dropped()
        out["w2 dropped"] = rpc.rpc_sync("w2", faults.dropped)
    rpc.shutdown(timeout=30)
    return out


def test_forks_survive_delayed_and_dropped_control_messages():
    out = spawn(_faulty_rank, nprocs=3, start_method="forkserver", timeout=90)[1]
    assert out["confirmed when the call ran"] is True
    assert out["while in flight"] == [1] * 8
    assert out["w2 registered"] == (1, 1, 1)
    assert out["pending children"] == 0
    assert out["end"] == (0, 0, 0)
    assert out["w1 dropped"] == {"RREF_DELETE": 1}  # dropped once, then sent again
    assert out["w2 dropped"] == {"RREF_ACCEPT": 1}


class _Counter:
    def __init__(self):
        self.total = 0

    def add(self, n):
        self.total += n
        return self.total

    def get(self):
        return self.total

    @functions.async_execution
    def add_later(self, n):
        fut = torch.futures.Future()
        fut.set_result(self.add(n) * 10)
        return fut


def _local_value_of(rref):
    return rref.local_value().get()


class _Slow(_Counter):
    def __init__(self):
        super().__init__()
        time.sleep(2)  # the owner makes the value slowly


def _proxy_rank(rank):
    rpc = _init(rank, 2)
    out = {}
    if rank == 0:
        rref = rpc.remote("w1", _Counter)
        out["sync"] = rref.rpc_sync().add(2)
        out["async"] = rref.rpc_async().add(3).wait()
        out["remote"] = rref.remote().get().to_here()
        out["async_execution"] = rref.rpc_sync().add_later(1)
        out["owner"] = (rref.owner_name(), rref.owner().id, rref.is_owner(),
                        rref.confirmed_by_owner())
        out["on owner"] = rpc.rpc_sync("w1", _local_value_of, args=(rref,))
        try:
            rref.local_value()
        except ValueError as e:
            out["local_value"] = str(e)
        local = rpc.RRef(torch.arange(3))
        out["local"] = (local.is_owner(), local.to_here(), local.local_value())
        out["local remote"] = rpc.rpc_sync("w1", _double_remote, args=([local],))
        try:
            import pickle

            pickle.dumps(rref)
        except TypeError as e:
            out["pickle"] = str(e)
        slow = rpc.remote("w1", _Slow)
        try:  # the proxy's timeout covers waiting for the value to exist, as torch's
            slow.rpc_sync(timeout=0.2).add(1)
        except TimeoutError as e:
            out["proxy timeout"] = str(e)
        out["after"] = slow.rpc_sync().add(1)  # without one, it waits and runs
    rpc.shutdown(timeout=30)
    return out


def _double_remote(rrefs):
    return rrefs[0].to_here() * 2


def test_proxies_run_methods_on_the_owner():
    out = spawn(_proxy_rank, nprocs=2, start_method="forkserver", timeout=60)[0]
    assert (out["sync"], out["async"], out["remote"]) == (2, 5, 5)
    assert out["async_execution"] == 60
    assert out["owner"] == ("w1", 1, False, True)
    assert out["on owner"] == 6
    assert "call it on the owner" in out["local_value"]
    assert out["local"][0] is True
    assert torch.equal(out["local"][1], torch.arange(3)) and torch.equal(out["local"][2],
                                                                         torch.arange(3))
    assert torch.equal(out["local remote"], torch.arange(3) * 2)
    assert "only be pickled inside an RPC" in out["pickle"]
    assert "RPC ran for more than" in out["proxy timeout"] and out["after"] == 1
