"""The RPC transport on real processes: tensors by value (through sockets and read from the
peer's memory), the auth handshake, and an agent that survives garbage."""

from __future__ import annotations

import os
import pickle
import secrets
import socket
import struct
import time

import pytest
import torch

from spmd.runtime import spawn

OPTS = dict(rpc_timeout=20.0, num_worker_threads=4)


def _init(rank: int, world: int, init_method: str | None = None):
    from spmd.runtime import rpc

    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world,
                 rpc_backend_options=rpc.RpcBackendOptions(init_method=init_method, **OPTS))
    return rpc


def _samples():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(64, 64, generator=gen)
    return {
        "float16": base.half(), "bfloat16": base.bfloat16(), "float64": base.double(),
        "int8": (base * 10).to(torch.int8), "uint8": (base * 10).to(torch.uint8),
        "int32": (base * 100).int(), "int64": (base * 100).long(), "bool": base > 0,
        "complex": torch.complex(base, -base), "conj": torch.complex(base, base).conj(),
        "scalar": torch.tensor(3.5), "empty": torch.empty(0, 3),
        "transposed": base.t(), "strided": base[::3, 1::2], "slice of big": base[5],
        "big": torch.arange(3 << 20, dtype=torch.float32),  # 12 MiB: read from memory
        "big int": torch.arange(1 << 20, dtype=torch.int64).reshape(1024, 1024).t(),
        "param": torch.nn.Parameter(base[:4].clone()),
        "requires grad": base[:2].clone().requires_grad_(True),
    }


def _inspect(values):
    """What arrived: each tensor, whether it is writable in place, and its flags."""
    out = {}
    for key, t in values.items():
        flags = (type(t).__name__, t.requires_grad, t.dtype, tuple(t.shape), t.is_contiguous())
        if t.numel() and not t.requires_grad and t.dtype != torch.bool:
            t.mul_(1)  # received tensors are ordinary, writable memory (no warning, no error)
        out[key] = (t.detach().clone(), flags)
    return out


def _reads_us():
    from spmd.runtime.rpc.api import current_agent

    agent = current_agent("test")
    return [link.reads_us for link in agent.transport.links()]


def _round_trip_rank(rank, cma):
    os.environ["SPMD_RPC_CMA"] = "1" if cma else "0"
    rpc = _init(rank, 2)
    out = None
    if rank == 0:
        samples = _samples()
        answer = rpc.rpc_sync("w1", _inspect, args=(samples,))
        back = rpc.rpc_sync("w1", _echo, args=(samples["big"],))  # a large answer
        # the reader's release is a message of its own, served beside the answer: give
        # it a moment under load
        deadline = time.monotonic() + 30.0
        while rpc.debug_info()["lent_buffers"] and time.monotonic() < deadline:
            time.sleep(0.01)
        out = (answer, back, _reads_us(), rpc.debug_info()["lent_buffers"])
    rpc.shutdown(timeout=30)
    return out


def _echo(value):
    return value


@pytest.mark.parametrize("cma", [True, False], ids=["memory-read", "socket"])
def test_tensors_arrive_by_value_with_dtype_shape_and_flags(cma):
    from spmd.runtime.rpc import cma as cma_module

    answer, back, reads_us, lent = spawn(_round_trip_rank, args=(cma,), nprocs=2,
                                         start_method="forkserver", timeout=60)[0]
    for key, sent in _samples().items():
        got, (kind, requires_grad, dtype, shape, contiguous) = answer[key]
        assert torch.equal(got, sent.detach().resolve_conj()), key
        assert (dtype, shape, requires_grad) == (sent.dtype, tuple(sent.shape),
                                                 sent.requires_grad), key
        assert kind == ("Parameter" if key == "param" else "Tensor"), key
        # a permuted dense tensor keeps its strides (as torch's RPC sends it); others
        # arrive contiguous
        assert contiguous == (key not in ("transposed", "big int")), key
    assert torch.equal(back, torch.arange(3 << 20, dtype=torch.float32))
    assert lent == 0  # every lent buffer was released
    probe = cma_module.Probe()
    if cma and cma_module.can_read(os.getpid(), probe.address, probe.content):
        assert reads_us == [True]
    if not cma:
        assert reads_us == [False]


# -- auth -----------------------------------------------------------------------------

_MARKER: dict = {}


def _touch(path):
    with open(path, "w") as f:
        f.write("unpickled")
    return 0


class _Trap:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (_touch, (self.path,))


def _address():
    from spmd.runtime.rpc.api import current_agent

    return current_agent("test").transport.address


def _intrude(address, marker):
    """Try every way in without the token; returns what the agent answered."""
    import zmq

    from spmd.runtime.rpc import wire

    seen = []
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 2000)
    sock.connect(address)
    header = wire.HEADER.pack(wire.VERSION, wire.Kind.CALL, 0, 0, 1, -1, -1)
    payload = pickle.dumps((_touch, (marker,), {}))
    sock.send_multipart([header + payload])  # no handshake at all
    sock.send_multipart([b"HELLO", b"WRONGMAG", wire.RANK.pack(0), secrets.token_bytes(32)])
    sock.send_multipart([b"HELLO", wire.MAGIC, wire.RANK.pack(1), secrets.token_bytes(32)])
    try:
        chal = sock.recv_multipart()
        seen.append(chal[0])
        sock.send_multipart([b"AUTH", secrets.token_bytes(32)])  # a guessed proof
        seen.append(sock.recv_multipart()[0])
    except zmq.Again:
        seen.append(b"no answer")
    sock.send_multipart([header + pickle.dumps((_touch, (marker,), {}))])
    sock.send_multipart([header, pickle.dumps(_Trap(marker))])
    time.sleep(0.3)
    sock.close(0)
    with socket.create_connection(tuple(address[6:].rsplit(":", 1))) as raw:  # not ZeroMQ
        raw.sendall(b"\xff" * 64 + b"GET / HTTP/1.1\r\n\r\n")
        time.sleep(0.1)
    ctx.term()
    return seen


def _auth_rank(rank, init_method, marker):
    os.environ["SPMD_AUTH_TOKEN"] = "the right token" if rank != 2 else "a wrong token"
    rpc = _init(rank, 3, init_method)
    out = {}
    if rank == 1:
        out["good"] = rpc.rpc_sync("w0", torch.add, args=(torch.ones(1), 1))
        out["intruder"] = _intrude(rpc.rpc_sync("w0", _address), marker)
        out["after"] = rpc.rpc_sync("w0", torch.add, args=(torch.ones(1), 2))
    if rank == 2:
        try:
            rpc.rpc_sync("w0", _touch, args=(marker,))
        except Exception as e:
            out["wrong token"] = (type(e).__name__, str(e))
    time.sleep(1.0)  # everyone is done before shutdown (w2 cannot talk to the others)
    rpc.shutdown(graceful=False)
    return out


def test_only_peers_holding_the_token_get_anything_unpickled(tmp_path):
    marker = str(tmp_path / "marker")
    url = f"file://{tmp_path / 'store'}"  # the file store has no token; the agents do
    out = spawn(_auth_rank, args=(url, marker), nprocs=3, start_method="forkserver",
                timeout=60)
    assert torch.equal(out[1]["good"], torch.full((1,), 2.0))
    assert out[1]["intruder"] == [b"CHAL", b"NO"]
    assert torch.equal(out[1]["after"], torch.full((1,), 3.0))  # still serving
    name, message = out[2]["wrong token"]
    assert name == "DistError" and "failed authentication: the auth tokens differ" in message
    assert not os.path.exists(marker)  # nothing from the intruder was ever unpickled


def _garbage_rank(rank):
    import zmq

    from spmd.runtime.rpc import wire

    rpc = _init(rank, 2)
    out = {}
    if rank == 1:
        address = rpc.rpc_sync("w0", _address)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 2000)
        sock.connect(address)
        sock.send_multipart([b"HELLO", wire.MAGIC, wire.RANK.pack(1), secrets.token_bytes(32)])
        sock.recv_multipart()
        sock.send_multipart([b"AUTH", b""])  # no token in this job: admitted
        out["admitted"] = sock.recv_multipart()[0]
        for frames in ([b"short"], [b"\x01" * 40], [b"\x07" * 32, b"x"],
                       [wire.HEADER.pack(wire.VERSION, 99, 0, 0, 1, -1, -1), b""],
                       [wire.HEADER.pack(wire.VERSION, wire.Kind.CALL, 0, 0, 2, -1, -1)
                        + b"not a pickle"],
                       [wire.HEADER.pack(wire.VERSION, wire.Kind.CALL, wire.FLAG_LENT, 0, 3,
                                         -1, -1), b"", struct.pack("<qI", 1, 5)],
                       [wire.HEADER.pack(wire.VERSION, wire.Kind.RESPONSE, 0, 0, 77, -1, -1)]):
            sock.send_multipart(frames)
        time.sleep(0.3)
        sock.close(0)
        ctx.term()
        out["after"] = rpc.rpc_sync("w0", torch.add, args=(torch.ones(1), 5))
    rpc.shutdown(timeout=30)
    return out


def test_malformed_messages_are_dropped_and_the_agent_keeps_serving():
    out = spawn(_garbage_rank, nprocs=2, start_method="forkserver", timeout=60)[1]
    assert out["admitted"] == b"OK"
    assert torch.equal(out["after"], torch.full((1,), 6.0))
