"""spmd.runtime.rpc calls on real worker processes: results, futures, errors, bad input."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

from spmd.runtime import spawn
from spmd.runtime.rpc import functions

OPTS = dict(rpc_timeout=20.0, num_worker_threads=4)


def _init(rank: int, world: int, **kw):
    from spmd.runtime import rpc

    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world,
                 rpc_backend_options=rpc.RpcBackendOptions(**{**OPTS, **kw}))
    return rpc


def _scaled(x, factor=1, *, shift=0):
    return x * factor + shift


_calls = []


def _count(tag):
    _calls.append(tag)
    return len(_calls)


def _calls_seen():
    return list(_calls)


def _calls_rank(rank):
    rpc = _init(rank, 2)
    out = {}
    if rank == 0:
        t = torch.arange(4.0)
        w1 = rpc.get_worker_info("w1")
        out["by_name"] = rpc.rpc_sync("w1", _scaled, args=(t, 2), kwargs={"shift": 1})
        out["by_rank"] = rpc.rpc_sync(1, _scaled, args=[t], kwargs={"shift": 3})
        out["by_info"] = rpc.rpc_sync(w1, torch.add, args=(t, 1))
        out["self"] = rpc.rpc_sync("w0", _scaled, args=(t, 3))
        fut = rpc.rpc_async("w1", _scaled, args=(t, 5))
        chained = fut.then(lambda f: f.value() + 100)
        seen = threading.Event()
        fut.add_done_callback(lambda f: seen.set())
        out["async"] = fut.wait()
        out["then"] = chained.wait()
        out["callback"] = seen.wait(5)
        futs = [rpc.rpc_async("w1", _count, args=(i,)) for i in range(8)]
        torch.futures.wait_all(futs)
        out["counts"] = sorted(f.value() for f in futs)
        out["remote"] = rpc.remote("w1", _scaled, args=(t, 7)).to_here()
        out["infos"] = rpc.get_all_worker_infos()
        out["me"] = rpc.get_worker_info()
        out["nested"] = rpc.rpc_sync("w1", _echo, args=({"a": [t, (t + 1, "x")], "b": None},))
    rpc.shutdown(timeout=30)
    return out


def _echo(value):
    return value


def test_calls_return_results_by_name_rank_and_worker_info():
    out = spawn(_calls_rank, nprocs=2, start_method="forkserver", timeout=60)[0]
    t = torch.arange(4.0)
    assert torch.equal(out["by_name"], t * 2 + 1)
    assert torch.equal(out["by_rank"], t + 3)
    assert torch.equal(out["by_info"], t + 1)
    assert torch.equal(out["self"], t * 3)
    assert torch.equal(out["async"], t * 5)
    assert torch.equal(out["then"], t * 5 + 100)
    assert out["callback"] is True
    assert out["counts"] == list(range(1, 9))
    assert torch.equal(out["remote"], t * 7)
    assert [(i.name, i.id) for i in out["infos"]] == [("w0", 0), ("w1", 1)]
    assert (out["me"].name, out["me"].id) == ("w0", 0)
    assert torch.equal(out["nested"]["a"][0], t) and out["nested"]["a"][1][1] == "x"
    assert out["nested"]["b"] is None


class _NeedsTwo(Exception):
    def __init__(self, code, detail):
        super().__init__(code, detail)


def _raise_value_error(x):
    raise ValueError(f"bad value {x}")


def _raise_custom():
    raise _NeedsTwo(7, "detail")


_stderr: list = []


def _capture_stderr():
    import io
    import sys

    _stderr.append(sys.stderr)
    sys.stderr = io.StringIO()


def _captured_stderr():
    import sys

    text, sys.stderr = sys.stderr.getvalue(), _stderr.pop()
    return text


@functions.async_execution
def _async_wrong():
    return 3  # an async_execution function must return a Future


def _defined_on_the_caller_only():
    return 1


def _forget_it():
    import sys

    delattr(sys.modules[__name__], "_defined_on_the_caller_only")


def _errors_rank(rank):
    from spmd.runtime.rpc import RemoteError

    rpc = _init(rank, 2)
    out = {}
    if rank == 0:
        rpc.rpc_sync("w1", _capture_stderr)
        try:
            rpc.rpc_sync("w1", _raise_value_error, args=(42,))
        except ValueError as e:
            out["sync"] = str(e)
        out["callee stderr"] = rpc.rpc_sync("w1", _captured_stderr)
        try:
            rpc.rpc_async("w1", _raise_value_error, args=(43,)).wait()
        except ValueError as e:
            out["async"] = str(e)
        try:
            rpc.remote("w1", _raise_value_error, args=(44,)).to_here()
        except ValueError as e:
            out["remote"] = str(e)
        try:
            rpc.rpc_sync("w1", _raise_custom)
        except RemoteError as e:
            out["custom"] = str(e)
        rpc.rpc_sync("w1", _forget_it)
        try:
            rpc.rpc_sync("w1", _defined_on_the_caller_only)
        except AttributeError as e:  # and torch's RuntimeError
            out["missing on callee"] = (str(e), isinstance(e, RuntimeError))
        out["after"] = rpc.rpc_sync("w1", torch.add, args=(torch.ones(1), 1))
    rpc.shutdown(timeout=30)
    return out


def test_remote_exceptions_reraise_with_the_remote_traceback():
    out = spawn(_errors_rank, nprocs=2, start_method="forkserver", timeout=60)[0]
    for key, value in (("sync", 42), ("async", 43), ("remote", 44)):
        message = out[key]
        assert message.startswith(f"bad value {value}"), message
        assert "Remote traceback (on worker 'w1' (rank 1)" in message
        assert "in _raise_value_error" in message and "Traceback (most recent call last)" in message
    # as torch's: the callee's stderr shows the error where it happened (its log's
    # last-resort handler: the worker configured no logging)
    assert "On WorkerInfo(name='w1', id=1)" in out["callee stderr"], out["callee stderr"]
    assert "bad value 42" in out["callee stderr"]
    assert "_NeedsTwo" in out["custom"] and "in _raise_custom" in out["custom"]
    assert "Original exception on remote side was" in out["custom"]  # torch's words too
    message, is_runtime_error = out["missing on callee"]
    assert "_defined_on_the_caller_only" in message and is_runtime_error
    assert "RPC pickler does not serialize function code" in message
    assert torch.equal(out["after"], torch.full((1,), 2.0))


def _bad_input_rank(rank):
    from spmd.runtime import rpc

    out = {}
    try:
        rpc.rpc_sync("w0", torch.add)
    except RuntimeError as e:
        out["before_init"] = str(e)
    for name, call in [("bad name", lambda: rpc.init_rpc("has space", rank=0, world_size=1)),
                       ("long name", lambda: rpc.init_rpc("a" * 129, rank=0, world_size=1)),
                       ("zero rpc_timeout", lambda: rpc.RpcBackendOptions(rpc_timeout=0)),
                       ("threads", lambda: rpc.RpcBackendOptions(num_worker_threads=0))]:
        try:
            call()
        except (TypeError, ValueError) as e:
            out[name] = "ValueError" if isinstance(e, ValueError) else type(e).__name__
            out[name + " text"] = str(e)
    rpc = _init(rank, 1)
    checks = {
        "unknown name": lambda: rpc.rpc_sync("nobody", _count, args=(1,)),
        "unknown rank": lambda: rpc.rpc_sync(5, _count, args=(1,)),
        "bad to": lambda: rpc.rpc_sync(1.5, _count, args=(1,)),
        "not callable": lambda: rpc.rpc_sync("w0", 3),
        "args type": lambda: rpc.rpc_sync("w0", _count, args="abc"),
        "kwargs type": lambda: rpc.rpc_sync("w0", _count, args=(1,), kwargs=[1]),
        "lambda": lambda: rpc.rpc_sync("w0", lambda: 1),
        "unpicklable arg": lambda: rpc.rpc_async("w0", _count, args=(threading.Lock(),)),
        "zero timeout": lambda: rpc.rpc_sync("w0", _count, args=(1,), timeout=0),
        "remote lambda": lambda: rpc.remote("w0", lambda: 1),
        "again": lambda: rpc.init_rpc("w0", rank=0, world_size=1),
        "async wrong": lambda: rpc.rpc_sync("w0", _async_wrong),
        # remote(): the RRef gets the error (it used to wait out the timeout)
        "async wrong remote": lambda: rpc.remote("w0", _async_wrong).to_here(timeout=10),
    }
    for name, call in checks.items():
        try:
            call()
            out[name] = None
        except (TypeError, ValueError, RuntimeError) as e:
            # every class the error is (one may also be a RuntimeError, as torch's is)
            out[name] = ([c.__name__ for c in type(e).__mro__], str(e))
    out["sent"] = rpc.rpc_sync("w0", _calls_seen)
    import gc

    gc.collect()  # the failed remote()'s RRef, held by its error's traceback until now
    deadline = time.monotonic() + 30  # its deletion is a message to this worker itself
    while (rpc.debug_info()["owner_rrefs"] or rpc.debug_info()["pending_requests"]) and \
            time.monotonic() < deadline:
        time.sleep(0.02)
    out["debug"] = rpc.debug_info()
    rpc.shutdown(timeout=10)
    return out


def test_bad_input_raises_before_anything_is_sent():
    out = spawn(_bad_input_rank, nprocs=1, start_method="forkserver", timeout=60)[0]
    assert "init_rpc() first" in out["before_init"]
    assert "Current RPC agent is not set" in out["before_init"]  # torch's words too
    assert out["bad name"] == "ValueError" and out["zero rpc_timeout"] == "ValueError"
    assert out["long name"] == "ValueError" and "shorter than 128" in out["long name text"]
    assert out["threads"] == "ValueError"
    # a ValueError and, as torch raises there, a RuntimeError
    expected = {"unknown name": ("InvalidArgumentError", "no worker is called 'nobody'"),
                "unknown rank": ("InvalidArgumentError", "no worker has rank 5"),
                "bad to": ("TypeError", "to must be a worker name"),  # and torch's ValueError
                "not callable": ("TypeError", "func must be callable"),
                "args type": ("TypeError", "args must be a tuple or list"),
                "kwargs type": ("TypeError", "kwargs must be a dict"),
                "lambda": ("TypeError", "cannot pickle"),
                "unpicklable arg": ("TypeError", "cannot pickle"),
                "zero timeout": ("ValueError", "no infinite timeouts"),
                "remote lambda": ("TypeError", "cannot pickle"),
                "again": ("RuntimeError", "already initialized"),
                "async wrong": ("RuntimeError", "must return a torch.futures.Future"),
                "async wrong remote": ("RuntimeError", "must return a torch.futures.Future")}
    for name, (kind, text) in expected.items():
        assert out[name] is not None and kind in out[name][0] and text in out[name][1], \
            (name, out[name])
    assert "ValueError" in out["bad to"][0]
    assert out["sent"] == []  # none of the bad calls ran
    assert out["debug"]["pending_requests"] == 0 and out["debug"]["owner_rrefs"] == 0


# -- async_execution: a batch answered together, with one worker thread -------------------

class _Batcher:
    pending: list = []
    lock = threading.Lock()

    @staticmethod
    @functions.async_execution
    def add(trainer, value):
        fut = torch.futures.Future()
        with _Batcher.lock:
            _Batcher.pending.append((fut, value))
            if len(_Batcher.pending) < 2:
                return fut
            batch, _Batcher.pending = _Batcher.pending, []
        total = sum(v for _, v in batch)
        for f, _ in batch:
            f.set_result(total)
        return fut


def _batching_rank(rank):
    rpc = _init(rank, 3, num_worker_threads=1)  # blocking in add() would deadlock
    out = None
    if rank > 0:
        start = time.monotonic()
        out = (rpc.rpc_sync("w0", _Batcher.add, args=(rank, torch.tensor(float(rank)))),
               time.monotonic() - start)
    rpc.shutdown(timeout=30)
    return out


def test_async_execution_answers_a_batch_when_its_future_completes():
    out = spawn(_batching_rank, nprocs=3, start_method="forkserver", timeout=60)
    for total, elapsed in out[1:]:
        assert float(total) == 3.0  # both trainers' values: answered after the second came
        assert elapsed < OPTS["rpc_timeout"]  # answered when the batch was, not timed out


def _thread_rank(rank):
    rpc = _init(rank, 2)
    other = f"w{1 - rank}"
    value = rpc.rpc_sync(other, _scaled, args=(torch.ones(2), rank + 2))
    rref = rpc.remote(other, torch.zeros, args=(3,))
    rpc.shutdown(timeout=30)
    return value, rref.is_owner()


def test_ranks_can_be_threads_of_one_process():
    out = spawn(_thread_rank, nprocs=2, start_method="thread", timeout=60)
    assert torch.equal(out[0][0], torch.full((2,), 2.0))
    assert torch.equal(out[1][0], torch.full((2,), 3.0))
    assert out[0][1] is False and out[1][1] is False


def _reinit_rank(rank):
    from spmd import runtime as dist
    from spmd.runtime import rpc

    results = []
    for round_no in range(2):  # a fresh store on the same MASTER_PORT each time
        rpc.init_rpc(f"again{rank}", rank=rank, world_size=2)
        results.append(rpc.rpc_sync(f"again{1 - rank}", _scaled, args=(torch.ones(1), round_no)))
        rpc.shutdown(timeout=30)
    dist.init_process_group("gloo")  # env:// too: RPC shares its store, not its port
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
    results.append(rpc.rpc_sync(f"w{1 - rank}", _scaled, args=(torch.ones(1), 10)))
    rpc.shutdown(timeout=30)
    dist.destroy_process_group()
    return results


def test_rpc_initializes_again_after_shutdown_and_shares_a_process_group_store():
    out = spawn(_reinit_rank, nprocs=2, start_method="forkserver", timeout=60)
    for results in out:
        assert [r.item() for r in results] == [0.0, 1.0, 10.0]


def _group_outlives_rpc_rank(rank):
    from spmd import runtime as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=10))
    rpc = _init(rank, 2)  # shares the group's store
    rpc.rpc_sync(f"w{1 - rank}", _scaled, args=(torch.ones(1),))
    rpc.shutdown(timeout=10)
    store = dist.groups.world().store  # every rank's, not only the coordinator's, is open
    store.set(f"after_rpc/{rank}", str(rank))
    seen = store.get(f"after_rpc/{1 - rank}")
    dist.barrier()
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.destroy_process_group()
    return seen, total.item()


def test_rpc_shutdown_leaves_a_shared_store_to_the_process_group():
    out = spawn(_group_outlives_rpc_rank, nprocs=2, start_method="thread", timeout=30)
    assert out == [(b"1", 2.0), (b"0", 2.0)]


def test_options_and_device_maps_are_checked_when_built():
    from spmd.runtime import rpc

    opts = rpc.RpcBackendOptions(rpc_timeout=5, num_worker_threads=2)
    opts.set_device_map("w1", {0: 1, "cuda:1": "cuda:0"})
    assert opts.device_maps == {"w1": {"cuda:0": "cuda:1", "cuda:1": "cuda:0"}}
    assert rpc.TensorPipeRpcBackendOptions is rpc.RpcBackendOptions
    assert rpc.BackendType.TENSORPIPE is rpc.BackendType.ZMQ
    bad = [(lambda: opts.set_device_map("w1", {"cpu": "cuda:0"}), ValueError, "accelerator"),
           (lambda: opts.set_device_map("w1", {0: "nonsense"}), ValueError, "not a device"),
           (lambda: opts.set_device_map("w2", {0: 1, 2: 1}), ValueError, "two local devices"),
           (lambda: opts.set_device_map(3, {0: 1}), TypeError, "worker name"),
           (lambda: rpc.RpcBackendOptions(rpc_timeout=float("inf")), ValueError, "finite"),
           (lambda: rpc.RpcBackendOptions(rpc_timeout="5"), TypeError, "number of seconds"),
           (lambda: rpc.RpcBackendOptions(init_method=5), TypeError, "init_method"),
           (lambda: rpc.init_rpc("w0", backend="gloo"), TypeError, "BackendType")]
    for call, kind, text in bad:
        with pytest.raises(kind, match=text):
            call()
