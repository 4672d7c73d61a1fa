"""RPCs in torch's legacy autograd profiler, named as torch names them, and
``RRef._get_type`` with torch's ``blocking``/``timeout``."""

from __future__ import annotations

import warnings

import torch

from spmd.runtime import rpc, spawn
from spmd.runtime.rpc.internal import RPCExecMode, _build_rpc_profiling_key


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _names(prof) -> list[str]:
    return [e.name for e in prof.function_events]


def _worker(rank: int) -> dict | None:
    from torch.autograd.profiler_legacy import profile

    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2,
                 rpc_backend_options=rpc.RpcBackendOptions(rpc_timeout=20))
    out = None
    if rank == 0:
        out = {}
        x = torch.ones(3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch deprecates the legacy profiler
            with profile() as prof:
                with torch.autograd.profiler.record_function("outer"):
                    out["sync"] = rpc.rpc_sync("w1", _double, args=(x,))
                    out["async"] = rpc.rpc_async("w1", _double, args=(x,)).wait()
                    rref = rpc.remote("w1", _double, args=(x,))
                    rref._get_profiling_future().wait()
            out["events"] = [(e.name, e.time_range.start, e.time_range.end, e.count)
                             for e in prof.function_events]
            with torch.profiler.profile() as kineto:  # torch records RPCs under the legacy
                rpc.rpc_sync("w1", _double, args=(x,))  # profiler only
            out["kineto"] = [e.name for e in kineto.events()]
            user = rpc.remote("w1", torch.ones, args=(2,))
            with profile() as prof:
                first = user._get_type(blocking=False)
                again = user._get_type(blocking=False)
                out["type"] = (first.wait(), first is again, user._get_type())
            out["type events"] = _names(prof)
            with profile() as prof:
                out["cached"] = user._get_type()
            out["cached events"] = _names(prof)
            owned = rpc.RRef(torch.zeros(1))
            with profile() as prof:
                out["owner type"] = owned._get_type(blocking=False).wait()
            out["owner events"] = _names(prof)
    rpc.shutdown()
    return out


def test_rpcs_are_spans_of_torchs_legacy_profiler_named_as_torch_names_them():
    out = spawn(_worker, nprocs=2, start_method="forkserver", timeout=90)[0]
    for key in ("sync", "async"):
        assert torch.equal(out[key], torch.full((3,), 2.0))
    spans = {name: (start, end, count) for name, start, end, count in out["events"]}
    outer = spans["outer"]
    for mode in (RPCExecMode.SYNC, RPCExecMode.ASYNC, RPCExecMode.REMOTE):
        key = _build_rpc_profiling_key(mode, "_double", "w0", "w1")
        assert key == f"rpc_{mode.value}#_double(w0 -> w1)"
        start, end, count = spans[key]
        assert count == 1 and outer[0] <= start <= end <= outer[1], (key, spans)
    assert not any(name.startswith("rpc_") for name in out["kineto"])
    assert out["type"] == (torch.Tensor, True, torch.Tensor)
    asked = [n for n in out["type events"] if n.startswith("rpc_async#_rref_typeof_on_owner")]
    assert asked == ["rpc_async#_rref_typeof_on_owner(w0 -> w1)"]  # one RPC for both calls
    assert out["cached"] is torch.Tensor
    assert not any(n.startswith("rpc_") for n in out["cached events"])  # kept, not asked
    assert out["owner type"] is torch.Tensor
    assert not any(n.startswith("rpc_") for n in out["owner events"])  # the owner knows
