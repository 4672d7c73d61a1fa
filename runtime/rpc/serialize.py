"""Pickle protocol 5 with tensor data out of band, and the frames a message is made of.

A tensor pickles as its metadata plus one ``PickleBuffer`` over its bytes: pickle hands
the buffer to ``buffer_callback`` instead of copying it, and the agent sends it as its
own ZeroMQ frame (``copy=False``) or, to a same-host peer that can, lends it to be read
straight from this process (see ``cma``). On the receiver the tensor is a view of the
received frame: no copy after the socket. Only the tensor's own bytes travel, not the
whole storage of a view. Accelerator tensors travel through host memory and arrive on
the CPU, or on the device a device map names.

Objects that need the RPC context to pickle (RRefs) define ``_rpc_reduce_(state)``;
tensors that require grad inside a distributed autograd context are collected in
``state.grad_tensors`` so the agent can record the send, and the receiver registers them
as received through the load state of the thread that unpickles.
"""

from __future__ import annotations

import ctypes
import io
import pickle
import threading
import traceback
from typing import Any, Callable

import torch

from spmd.runtime.errors import WrongTypeError, also_runtime_error
from spmd.runtime.rpc import wire
from spmd.runtime.rpc.options import RemoteError

__all__ = ["DumpState", "LoadState", "Encoded", "encode", "decode", "loading",
           "pack_exception", "unpack_exception"]

INBAND_MAX = 4096  # smaller buffers ride inside the pickle: a frame costs more than a copy
PACK_MAX = 1 << 16  # a message without buffers below this size is one frame: header+payload
_Parameter = torch.nn.Parameter


class DumpState:
    """What pickling one message needs to know and collects."""

    __slots__ = ("agent", "device_map", "record_grads", "grad_tensors", "rollbacks")

    def __init__(self, agent: Any, device_map: dict[str, str] | None,
                 record_grads: bool) -> None:
        self.agent = agent
        self.device_map = device_map
        self.record_grads = record_grads
        self.grad_tensors: list[torch.Tensor] = []
        self.rollbacks: list[Callable[[], None]] = []  # undo RRef forks if never sent

    def rollback(self) -> None:
        for undo in self.rollbacks:
            try:
                undo()
            except Exception:
                pass
        self.rollbacks.clear()


class LoadState:
    """What unpickling one message needs: who sent it, and its autograd context."""

    __slots__ = ("agent", "peer", "ctx", "grad_msg_id", "pending")

    def __init__(self, agent: Any, peer: int, ctx: Any = None, grad_msg_id: int = -1,
                 pending: list | None = None) -> None:
        self.agent = agent
        self.peer = peer
        self.ctx = ctx
        self.grad_msg_id = grad_msg_id
        # a request's RRef forks that the owner has yet to register (futures, set then)
        self.pending = pending


class Encoded:
    """A pickled object and the out-of-band buffers it refers to, in pickle's order."""

    __slots__ = ("payload", "buffers")

    def __init__(self, payload: bytes, buffers: list[pickle.PickleBuffer]) -> None:
        self.payload = payload
        self.buffers = buffers

    def frames(self, header: bytes, lend_id: int, threshold: int | None
               ) -> tuple[list[Any], list[Any]]:
        """The message's frames, and the buffers lent (kept alive until released).

        With ``threshold``, buffers of at least that many bytes are described (address
        and size) instead of sent; the receiver reads them from this process.
        """
        if not self.buffers:
            if len(self.payload) < PACK_MAX:  # one frame: a multipart send costs 4x one
                return [header + self.payload], []
            return [header, self.payload], []
        raws = [b.raw() for b in self.buffers]
        lent: list[Any] = []
        items: list[tuple[int, int, int]] = []
        if threshold is not None:
            for raw in raws:
                if raw.nbytes >= threshold:
                    try:
                        address = ctypes.addressof(ctypes.c_char.from_buffer(raw))
                    except (TypeError, ValueError):  # read-only: send it inline
                        items.append((0, 0, raw.nbytes))
                        continue
                    items.append((1, address, raw.nbytes))
                    lent.append(raw)
                else:
                    items.append((0, 0, raw.nbytes))
        if not lent:
            return [header, self.payload, *raws], []
        head = wire.HEADER.unpack(header)
        header = wire.HEADER.pack(head[0], head[1], head[2] | wire.FLAG_LENT, *head[3:])
        desc = wire.LENT_HEAD.pack(lend_id, len(items)) + b"".join(
            wire.LENT_ITEM.pack(*item) for item in items)
        inline = [raw for raw, item in zip(raws, items) if item[0] == 0]
        return [header, self.payload, desc, *inline], lent


class _Pickler(pickle.Pickler):
    """Reused by its thread (building a pickler costs more than a small call's pickle)."""

    def __init__(self) -> None:
        self.file = io.BytesIO()
        super().__init__(self.file, protocol=5, buffer_callback=self._buffer)
        self.state: DumpState | None = None
        self.oob: list = []
        self.busy = False

    def _buffer(self, buf: pickle.PickleBuffer) -> bool:
        if buf.raw().nbytes < INBAND_MAX:
            return True  # true: serialise in band
        self.oob.append(buf)
        return False

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is torch.Tensor or cls is _Parameter:
            return _reduce_tensor(obj, self.state)
        hook = getattr(cls, "_rpc_reduce_", None)
        if hook is not None:
            return hook(obj, self.state)
        return NotImplemented


class _Picklers(threading.local):
    pickler: _Pickler | None = None


_picklers = _Picklers()


def _reduce_tensor(t: torch.Tensor, state: DumpState) -> Any:
    slot = -1
    if t.requires_grad and state.record_grads:
        slot = len(state.grad_tensors)
        state.grad_tensors.append(t)
    if t.layout is not torch.strided or t.is_quantized or t.is_nested:
        if not t.requires_grad:
            return NotImplemented  # torch's own pickling, in band
        # torch's pickling of a sparse tensor drops requires_grad: the data goes that way,
        # requires_grad and the autograd slot around it
        return _rebuild_other, (t.detach(), slot)
    data = t.detach()
    device = None
    if data.device.type != "cpu":
        if state.device_map:
            device = state.device_map.get(str(data.device))
        data = data.cpu()  # through host memory
    if data.is_conj() or data.is_neg():
        data = data.resolve_conj().resolve_neg()
    order = strides = None
    if not data.is_contiguous() and data.numel():
        order = _dense_order(data)
        if order is not None:
            # a permuted dense tensor (a transpose, say) travels in its own memory order
            # and arrives with its strides
            data = data.permute(order)
        else:
            span = _span(data.shape, data.stride())
            if span * data.element_size() < _RECOPY_BYTES or span < 2 * data.numel():
                # a view with gaps (or overlaps) travels as the memory it spans and
                # arrives with its strides, as torch's RPC sends it
                strides = tuple(data.stride())
                shape = tuple(data.shape)
                data = torch.as_strided(data, (span,), (1,), data.storage_offset())
            else:  # most of that memory is gaps: only the values travel
                data = data.contiguous()
    if strides is None:
        shape = tuple(data.shape)
    if data.numel() == 0:
        buf: Any = b""
    else:
        buf = pickle.PickleBuffer(data.reshape(-1).view(torch.uint8).numpy())
    return _rebuild_tensor, (data.dtype, shape, t.requires_grad, device, slot,
                             type(t) is _Parameter, buf, order, strides)


def _span(shape: Any, strides: Any) -> int:
    """Elements of memory a non-empty strided view spans, from its first to its last."""
    return 1 + sum((n - 1) * st for n, st in zip(shape, strides))


# a gapped view whose span is at least this many bytes and twice its values travels as
# its values alone (torch's RPC clones such a view rather than send its storage)
_RECOPY_BYTES = 8 * 1024


def _dense_order(t: torch.Tensor) -> list[int] | None:
    """The dimension order that makes ``t`` contiguous when its elements fill their memory
    without gaps or overlaps in some order (permuted dense); None otherwise."""
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d]))
    permuted = t.permute(order)
    return order if permuted.is_contiguous() else None


class _Loading(threading.local):
    state: LoadState | None = None


loading = _Loading()


def _rebuild_tensor(dtype: torch.dtype, shape: tuple, requires_grad: bool, device: str | None,
                    slot: int, is_param: bool, buf: Any, order: list[int] | None = None,
                    strides: tuple | None = None) -> torch.Tensor:
    count = 1
    for n in shape:
        count *= n
    if strides is not None:  # the memory a strided view spans
        if len(strides) != len(shape) or any(not isinstance(s, int) or s < 0 for s in strides):
            raise ValueError(f"tensor of shape {shape} with strides {strides}: bad strides")
        count = _span(shape, strides) if count else 0
    nbytes = count * dtype.itemsize
    if nbytes == 0:
        t = torch.empty(shape, dtype=dtype)
    else:
        size = memoryview(buf).nbytes
        if size != nbytes:
            raise ValueError(f"tensor of shape {shape} and {dtype} needs {nbytes} bytes, the "
                             f"message carried {size}")
        t = torch.frombuffer(buf, dtype=torch.uint8).view(dtype)
        t = t.as_strided(shape, strides) if strides is not None else t.view(shape)
    if order is not None:  # back to the sender's dimension order, strides included
        inverse = [0] * len(order)
        for position, dim in enumerate(order):
            inverse[dim] = position
        t = t.permute(inverse)
    if device is not None:
        t = t.to(device)
    if is_param:
        t = _Parameter(t, requires_grad)
    elif requires_grad:
        t.requires_grad_(True)
    state = loading.state
    if slot >= 0 and state is not None and state.ctx is not None:
        state.ctx.record_recv(t, state.peer, state.grad_msg_id, slot)
    return t


def _rebuild_other(data: torch.Tensor, slot: int) -> torch.Tensor:
    """A sparse (or other non-strided) tensor that requires grad, rebuilt by torch's own
    unpickling, then made a leaf that requires grad and, in a context, a recv."""
    t = data.requires_grad_(True)
    state = loading.state
    if slot >= 0 and state is not None and state.ctx is not None:
        state.ctx.record_recv(t, state.peer, state.grad_msg_id, slot)
    return t


def encode(obj: Any, state: DumpState) -> Encoded:
    """Pickle ``obj``; ``TypeError`` naming the cause when it cannot be pickled."""
    pickler = _picklers.pickler
    if pickler is None or pickler.busy:  # busy: a reduce of ours pickles something else
        pickler = _Pickler()
        if _picklers.pickler is None:
            _picklers.pickler = pickler
    buffers: list[pickle.PickleBuffer] = []
    pickler.busy, pickler.state, pickler.oob = True, state, buffers
    file = pickler.file
    try:
        pickler.dump(obj)
        payload = file.getvalue()
    except Exception as e:
        state.rollback()
        # a TypeError, and the RuntimeError torch raises ("Can not pickle torch.futures.Future")
        raise WrongTypeError(f"cannot pickle {type(e).__name__}: {e}") from e
    finally:
        pickler.clear_memo()  # the memo would keep the arguments alive
        file.seek(0)
        file.truncate()
        pickler.busy, pickler.state, pickler.oob = False, None, []
    return Encoded(payload, buffers)


def decode(payload: Any, buffers: list[Any], state: LoadState) -> Any:
    """Unpickle a payload with its out-of-band ``buffers``, under ``state``."""
    previous = loading.state
    loading.state = state
    try:
        return pickle.loads(payload, buffers=buffers)
    finally:
        loading.state = previous


_TRACEBACK_MAX = 16384  # characters of one remote traceback kept (head and tail)


def pack_exception(exc: BaseException) -> tuple[str, str, str, bytes | None]:
    """(type name, message, formatted traceback, the pickled exception or None).

    An exception that itself came from another worker passes on as it is: its message
    already carries the traceback where it was raised. Wrapping it again at every hop
    doubled the text each time (a backward error four workers deep came back as 365 kB
    of nested tracebacks)."""
    cls = type(exc)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if getattr(exc, "_spmd_remote", False):
        return name, str(exc), "", _pickled(exc)
    text = "".join(traceback.format_exception(cls, exc, exc.__traceback__))
    if len(text) > _TRACEBACK_MAX:
        half = _TRACEBACK_MAX // 2
        text = f"{text[:half]}\n[... {len(text) - _TRACEBACK_MAX} characters ...]\n{text[-half:]}"
    return name, str(exc), text, _pickled(exc)


def _pickled(exc: BaseException) -> bytes | None:
    base = type(exc).__dict__.get("_spmd_twin_of")  # made by errors.also_runtime_error
    if base is not None:  # also a RuntimeError (errors.also_runtime_error): the caller
        try:               # rebuilds its own type and makes it one again
            plain = base(*exc.args)
            plain._spmd_also_runtime = True  # type: ignore[attr-defined]
            exc = plain
        except Exception:
            pass
    try:
        raw: bytes | None = pickle.dumps(exc, protocol=5)
        pickle.loads(raw)
    except Exception:
        raw = None
    return raw


def unpack_exception(info: tuple, where: str) -> BaseException:
    """The remote exception, rebuilt with its type where possible; the message carries the
    remote traceback and ``where`` it happened (once: one passed on by a worker in
    between keeps the traceback of where it was raised)."""
    type_name, message, text, raw = info
    full = f"{message}\n\nRemote traceback ({where}):\n{text.rstrip()}" if text else message
    cls = None
    also_runtime = False
    if raw is not None:
        try:
            loaded = pickle.loads(raw)
            cls, also_runtime = type(loaded), getattr(loaded, "_spmd_also_runtime", False)
        except Exception:
            cls = None
    exc: BaseException = RemoteError(
        f"{type_name} could not be rebuilt here. Original exception on remote side was "
        f"{type_name}: {full}" if text else full)
    if cls is not None:
        try:
            rebuilt = cls(full)
            if rebuilt.args and rebuilt.args[0] == full:
                exc = also_runtime_error(rebuilt) if also_runtime else rebuilt
        except Exception:
            pass
    try:
        exc._spmd_remote = True  # type: ignore[attr-defined]
    except Exception:
        pass
    return exc
