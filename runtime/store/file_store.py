"""A store in one file, shared by the processes of one machine (or a shared file system).

The file is an append-only log of records behind a 16-byte header (magic, generation).
Every access holds an ``flock`` on the file: exclusive to append, shared to read. Each
process keeps a cache of the log it has replayed and its offset, so a poll that finds the
file unchanged costs one ``fstat``. When the log grows to several times the live data, the
writer that notices rewrites it compacted and bumps the generation, which tells every
reader to replay from the start.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
import time
import weakref
from datetime import timedelta

from spmd.runtime.errors import DistStoreError, QueueEmptyError, StoreTimeoutError
from spmd.runtime.store.base import Store, compare_set_result, describe_missing, parse_counter

__all__ = ["FileStore"]

_MAGIC = b"SPMDFS01"
_HEADER = struct.Struct("<8sQ")  # magic, generation
_RECORD = struct.Struct("<BBII")  # op, namespace, key length, value length
_ITEM = struct.Struct("<I")  # a queue is one internal record: its items, each length-prefixed
_SET, _DELETE = 1, 2
_USER, _INTERNAL = 0, 1
_COMPACT_MIN_BYTES = 4 << 20  # never compact a log smaller than this
_POLL_MAX = 0.05  # seconds between polls of a blocked get, at most


class _Log:
    """The replayed state of the file: user keys, internal counters, offset, generation."""

    def __init__(self) -> None:
        self.reset(0)
        self.stamp: tuple[int, int] | None = None

    def reset(self, generation: int) -> None:
        self.generation = generation
        self.offset = _HEADER.size
        self.data: dict[str, bytes] = {}
        self.internal: dict[str, bytes] = {}
        self.live_bytes = 0

    def apply(self, buf: bytes) -> int:
        """Replay complete records of ``buf``; how many bytes were consumed."""
        pos, n = 0, len(buf)
        while pos + _RECORD.size <= n:
            op, ns, klen, vlen = _RECORD.unpack_from(buf, pos)
            end = pos + _RECORD.size + klen + vlen
            if end > n:
                break
            key = buf[pos + _RECORD.size : pos + _RECORD.size + klen].decode("utf-8")
            table = self.data if ns == _USER else self.internal
            old = table.pop(key, None)
            if old is not None:
                self.live_bytes -= len(key) + len(old)
            if op == _SET:
                value = buf[end - vlen : end]
                table[key] = value
                self.live_bytes += len(key) + len(value)
            pos = end
        return pos


def _record(op: int, ns: int, key: str, value: bytes = b"") -> bytes:
    k = key.encode("utf-8")
    return _RECORD.pack(op, ns, len(k), len(value)) + k + value


def _queue(key: str) -> str:
    """The internal record that holds queue ``key``'s items (absent when it has none)."""
    return f"queue/{key}"


class FileStore(Store):
    """A store kept in the file at ``path``, safe under concurrent use by many processes.

    Args:
        path: the file; created when missing. Every participant passes the same path.
        world_size: how many participants will use the file. When given, the file is
            removed once that many have called :meth:`close` and no instance (in any
            process) still has it open; when None, the file is left in place.
        timeout: how long blocking calls wait (default ``SPMD_STORE_TIMEOUT``).

    Example::

        store = FileStore("/tmp/job42.store", world_size=2)
        store.set("rank0", b"ready")
    """

    def __init__(
        self, path: str | os.PathLike[str], world_size: int | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        super().__init__(timeout)
        path = os.fspath(path)
        if not isinstance(path, str) or not path:
            raise ValueError(f"FileStore path must be a non-empty path, got {path!r}")
        if world_size is not None and (
            not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1
        ):
            raise ValueError(f"FileStore world_size must be a positive int, got {world_size!r}")
        self._path = os.path.abspath(path)
        self._world_size = world_size
        self._mutex = threading.Lock()  # threads of this process share one fd
        self._log = _Log()
        self._fd = -1
        self._pid = -1
        self._closed = False
        self._open()
        with self._locked(exclusive=True, op="open"):  # a new file's header, an old one's magic
            # every open instance counts: the file goes only when the last one closes (and
            # world_size participants have finished), as torch's FileStore does
            refs = parse_counter(self._log.internal.get("refs"), 1, "refs")
            self._append_record(_record(_SET, _INTERNAL, "refs", refs))
        # A process that forgets close() still counts as finished when it exits.
        self._finalizer = weakref.finalize(
            self, FileStore._finish, self._path, self._fd, world_size, self._pid, self._timeout
        )

    def clone(self) -> "FileStore":
        """Another user of the same file (it counts as one more open instance)."""
        return FileStore(self._path, self._world_size, self.timeout)

    @property
    def path(self) -> str:
        return self._path

    def __repr__(self) -> str:
        return f"FileStore({self._path!r}, world_size={self._world_size})"

    # -- file handling ----------------------------------------------------------------

    def _open(self) -> None:
        try:
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise DistStoreError(f"FileStore: cannot open {self._path!r}: {e.strerror}") from e
        self._pid = os.getpid()
        self._log = _Log()

    def _lock_file(self, exclusive: bool, op: str) -> None:
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        deadline = time.monotonic() + self._timeout
        delay = 0.0005
        while True:
            try:
                fcntl.flock(self._fd, mode)
                return
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise DistStoreError(f"FileStore {op}: flock({self._path!r}) failed: {e}")
            if time.monotonic() >= deadline:
                raise StoreTimeoutError(
                    f"FileStore {op}: timeout: could not lock {self._path!r} within "
                    f"{self._timeout:g}s (another process holds it)"
                )
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX)

    class _Held:
        def __init__(self, store: "FileStore", exclusive: bool, op: str) -> None:
            self.store, self.exclusive, self.op = store, exclusive, op

        def __enter__(self) -> None:
            store = self.store
            if store._closed:
                raise DistStoreError(f"FileStore {self.op}: the store at {store._path!r} is closed")
            store._mutex.acquire()
            try:
                if store._pid != os.getpid():  # forked: a shared fd would share the lock
                    store._open()
                store._lock_file(self.exclusive, self.op)
            except BaseException:
                store._mutex.release()
                raise
            try:
                store._refresh(self.exclusive)
            except BaseException:
                self.__exit__()
                raise

        def __exit__(self, *exc: object) -> None:
            try:
                fcntl.flock(self.store._fd, fcntl.LOCK_UN)
            finally:
                self.store._mutex.release()

    def _locked(self, exclusive: bool, op: str) -> "FileStore._Held":
        return FileStore._Held(self, exclusive, op)

    def _refresh(self, exclusive: bool) -> None:
        """Replay what other processes appended since this process last looked."""
        st = os.fstat(self._fd)
        stamp = (st.st_size, st.st_mtime_ns)
        log = self._log
        if stamp == log.stamp:
            return
        if st.st_size < _HEADER.size:
            if exclusive and st.st_size == 0:
                os.pwrite(self._fd, _HEADER.pack(_MAGIC, 0), 0)
                log.reset(0)
                log.stamp = None
                return
            if st.st_size == 0:
                log.reset(0)
                return
            raise DistStoreError(f"FileStore: {self._path!r} is truncated or not a store file")
        magic, generation = _HEADER.unpack(os.pread(self._fd, _HEADER.size, 0))
        if magic != _MAGIC:
            raise DistStoreError(f"FileStore: {self._path!r} is not an spmd store file")
        if generation != log.generation or st.st_size < log.offset:
            log.reset(generation)
        if st.st_size > log.offset:
            buf = os.pread(self._fd, st.st_size - log.offset, log.offset)
            log.offset += log.apply(buf)
        log.stamp = stamp

    def _append_record(self, rec: bytes) -> None:
        """Append under the exclusive lock, replay it, compact the log if it is bloated."""
        log = self._log
        view = memoryview(rec)
        offset = log.offset
        while view:
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written
        log.offset += log.apply(rec)
        if log.offset > _COMPACT_MIN_BYTES and log.offset > 4 * (log.live_bytes + 64 * (
            len(log.data) + len(log.internal)
        )):
            self._compact()
        st = os.fstat(self._fd)
        log.stamp = (st.st_size, st.st_mtime_ns)

    def _compact(self) -> None:
        log = self._log
        parts = [_HEADER.pack(_MAGIC, log.generation + 1)]
        parts += [_record(_SET, _USER, k, v) for k, v in log.data.items()]
        parts += [_record(_SET, _INTERNAL, k, v) for k, v in log.internal.items()]
        blob = b"".join(parts)
        os.pwrite(self._fd, blob, 0)
        os.ftruncate(self._fd, len(blob))
        log.generation += 1
        log.offset = len(blob)

    # -- Store ------------------------------------------------------------------------

    def _poll(self, keys: list[str], timeout: float, op: str) -> list[bytes]:
        """The values of ``keys`` once all are set (``get``), or nothing once each is set
        or has queued items (``wait``)."""
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while True:
            with self._locked(exclusive=False, op=op):
                data = self._log.data
                queues = {} if op == "get" else self._log.internal
                missing = [k for k in keys if k not in data and _queue(k) not in queues]
                if not missing:
                    return [data[k] for k in keys] if op == "get" else []
            if time.monotonic() >= deadline:
                raise StoreTimeoutError(
                    f"FileStore({self._path!r}).{op}: timeout: keys "
                    f"{describe_missing(missing)} were not set within {timeout:g}s"
                )
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, _POLL_MAX)

    def _multi_get(self, keys: list[str], timeout: float) -> list[bytes]:
        return self._poll(keys, timeout, "get")

    def _wait(self, keys: list[str], timeout: float) -> None:
        self._poll(keys, timeout, "wait")

    def _set(self, key: str, value: bytes) -> None:
        with self._locked(exclusive=True, op="set"):
            self._append_record(_record(_SET, _USER, key, value))

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        with self._locked(exclusive=True, op="multi_set"):
            self._append_record(b"".join(_record(_SET, _USER, k, v) for k, v in zip(keys, values)))

    def _add(self, key: str, amount: int) -> int:
        with self._locked(exclusive=True, op="add"):
            value = parse_counter(self._log.data.get(key), amount, key)
            self._append_record(_record(_SET, _USER, key, value))
            return int(value)

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._locked(exclusive=True, op="compare_set"):
            result, store = compare_set_result(self._log.data.get(key), expected, desired)
            if store:
                self._append_record(_record(_SET, _USER, key, desired))
            return result

    def _append(self, key: str, value: bytes) -> None:
        with self._locked(exclusive=True, op="append"):
            old = self._log.data.get(key, b"")
            self._append_record(_record(_SET, _USER, key, old + value))

    def _check(self, keys: list[str]) -> bool:
        with self._locked(exclusive=False, op="check"):
            log = self._log
            return all(k in log.data or _queue(k) in log.internal for k in keys)

    def _delete_key(self, key: str) -> bool:
        with self._locked(exclusive=True, op="delete_key"):
            if key not in self._log.data:
                return False
            self._append_record(_record(_DELETE, _USER, key))
            return True

    def _num_keys(self) -> int:
        with self._locked(exclusive=False, op="num_keys"):
            return len(self._log.data)

    def _queue_push(self, key: str, value: bytes) -> None:
        name = _queue(key)
        with self._locked(exclusive=True, op="queue_push"):
            items = self._log.internal.get(name, b"") + _ITEM.pack(len(value)) + value
            self._append_record(_record(_SET, _INTERNAL, name, items))

    def _queue_pop(self, key: str, timeout: float | None) -> bytes:
        name = _queue(key)
        deadline = time.monotonic() + (timeout or 0.0)
        delay = 0.0005
        while True:
            with self._locked(exclusive=False, op="queue_pop"):
                ready = name in self._log.internal
            if ready:
                with self._locked(exclusive=True, op="queue_pop"):
                    items = self._log.internal.get(name)
                    if items:  # unless another consumer took the last item meanwhile
                        (n,) = _ITEM.unpack_from(items)
                        rest = items[_ITEM.size + n:]
                        self._append_record(_record(_SET, _INTERNAL, name, rest) if rest
                                            else _record(_DELETE, _INTERNAL, name))
                        return bytes(items[_ITEM.size:_ITEM.size + n])
                continue
            if timeout is None:
                raise QueueEmptyError(f"FileStore({self._path!r}).queue_pop: queue {key!r} "
                                      f"is empty")
            if time.monotonic() >= deadline:
                raise StoreTimeoutError(f"FileStore({self._path!r}).queue_pop: timeout: queue "
                                        f"{key!r} stayed empty for {timeout:g}s")
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, _POLL_MAX)

    def _queue_len(self, key: str) -> int:
        with self._locked(exclusive=False, op="queue_len"):
            items = self._log.internal.get(_queue(key), b"")
        count, pos = 0, 0
        while pos < len(items):
            pos += _ITEM.size + _ITEM.unpack_from(items, pos)[0]
            count += 1
        return count

    # -- lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        """Mark this participant finished; the file is removed when ``world_size`` have
        finished and no instance of it is open any more."""
        if self._closed:
            return
        self._finalizer.detach()
        with self._mutex:
            self._closed = True
            FileStore._finish(self._path, self._fd, self._world_size, self._pid, self._timeout)

    @staticmethod
    def _finish(path: str, fd: int, world_size: int | None, pid: int, timeout: float) -> None:
        if os.getpid() != pid:
            return  # a forked child does not own the parent's registration
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        return
                    time.sleep(0.001)
            try:
                log = _Log()
                size = os.fstat(fd).st_size
                if size >= _HEADER.size:
                    log.offset = _HEADER.size
                    log.apply(os.pread(fd, size - _HEADER.size, _HEADER.size))
                    done = parse_counter(log.internal.get("finished"), 1, "finished")
                    refs = parse_counter(log.internal.get("refs"), -1, "refs")
                    os.pwrite(fd, _record(_SET, _INTERNAL, "finished", done)
                              + _record(_SET, _INTERNAL, "refs", refs), size)
                    if (world_size is not None and int(done) >= world_size
                            and int(refs) <= 0):
                        try:
                            os.unlink(path)
                        except FileNotFoundError:
                            pass
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass
        finally:
            os.close(fd)
