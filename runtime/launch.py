"""``spawn``: start local ranks for examples, notebooks and tests.

Each rank gets ``MASTER_ADDR``, ``MASTER_PORT`` (a free port), ``RANK``, ``LOCAL_RANK``
and ``WORLD_SIZE``, so ``init_process_group("gloo")`` needs no arguments. Return values
travel back as ordinary pickles (tensors by value, not as shared-memory handles), so they
survive the rank's process. The first rank to fail stops the others and its traceback is
raised here; nothing waits forever.

Thread-ranks hand back their return values as they are (no pickling), so a notebook can
return plans, figures or models from its ranks.

Multi-node jobs are launched with torchrun (``env://``), not with this.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import random
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, Sequence

from spmd.runtime.context import RankContext, rank_context
from spmd.runtime.errors import DistError, DistTimeoutError

__all__ = ["spawn", "SpawnContext", "SpawnError", "free_port"]

_START_METHODS = ("spawn", "fork", "forkserver", "thread")
_EXIT_GRACE = 10.0  # seconds a rank that returned may take to exit before it is killed


class SpawnError(DistError):
    """A rank raised, exited without returning, or hung past the timeout.

    Attributes: ``rank``, ``exitcode`` (None for a raised exception or a thread-rank),
    ``remote_traceback`` (the rank's formatted traceback, when it raised).
    """

    def __init__(
        self, message: str, rank: int, exitcode: int | None = None,
        remote_traceback: str | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.remote_traceback = remote_traceback


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``, drawn below the kernel's
    ephemeral range where it can: a port the kernel handed out (binding port 0) is one
    it may give the next outgoing connection of any process before the store binds it
    ("Address already in use", seen once in a CI-sized run); one below the range is only
    ever taken by a program that asks for it by number."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(max(1024, low - 12000), low) if low > 2048 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (32768 when it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _rank_env(rank: int, nprocs: int, port: int) -> dict[str, str]:
    return {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs), "LOCAL_WORLD_SIZE": str(nprocs),
    }


def _attempt(fn: Callable[..., Any], rank: int, args: tuple) -> tuple:
    """Run ``fn(rank, *args)``: ("ok", result) or ("error", traceback text, exception)."""
    try:
        return ("ok", fn(rank, *args))
    except BaseException as e:  # report everything, SystemExit and KeyboardInterrupt too
        return ("error", traceback.format_exc(), e)


def _encode(outcome: tuple, rank: int) -> bytes:
    """An outcome as bytes for the parent process (the exception pickled on its own, so an
    unpicklable exception still leaves its traceback)."""
    if outcome[0] == "ok":
        try:
            return pickle.dumps(outcome)
        except Exception as e:
            return pickle.dumps(("error", f"the return value of rank {rank} cannot be pickled: "
                                          f"{e!r}", None))
    _, text, exc = outcome
    try:
        raw: bytes | None = pickle.dumps(exc)
    except Exception:
        raw = None
    return pickle.dumps(("error", text, raw))


def _decode(message: bytes) -> tuple:
    outcome = pickle.loads(message)
    if outcome[0] == "ok" or outcome[2] is None:
        return outcome
    try:
        return ("error", outcome[1], pickle.loads(outcome[2]))
    except Exception:
        return ("error", outcome[1], None)


def _child(fn: Callable[..., Any], rank: int, args: tuple, env: dict[str, str],
           conn: multiprocessing.connection.Connection) -> None:
    os.environ.update(env)
    message = _encode(_attempt(fn, rank, args), rank)
    try:
        conn.send_bytes(message)
    finally:
        conn.close()
    sys.stdout.flush()
    sys.stderr.flush()


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _raise_failure(rank: int, outcome: tuple | None, exitcode: int | None) -> None:
    if outcome is None:
        raise SpawnError(f"rank {rank} {_describe_exit(exitcode)} without returning",
                         rank, exitcode)
    _, text, cause = outcome
    first = text.strip().splitlines()[-1] if text.strip() else "an error"
    err = SpawnError(f"rank {rank} raised {first}\n\n--- traceback of rank {rank} ---\n{text}",
                     rank, None, text)
    raise err from (cause if isinstance(cause, BaseException) else None)


class SpawnContext:
    """Handle on ranks started with ``spawn(join=False)``; ``join()`` returns their results."""

    def __init__(self, nprocs: int, timeout: float | None) -> None:
        self.nprocs = nprocs
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._timeout = timeout
        self._results: dict[int, Any] = {}

    def _timeout_error(self, pending: Sequence[int]) -> DistTimeoutError:
        ranks = ", ".join(map(str, sorted(pending)))
        return DistTimeoutError(
            f"spawn: timeout: rank(s) {ranks} did not finish within {self._timeout:g}s; "
            f"stopped"
        )

    def _join_deadline(self, timeout: float | None) -> float | None:
        """The earlier of spawn's deadline and ``timeout`` seconds from now (None: none)."""
        if timeout is None:
            return self._deadline
        end = time.monotonic() + timeout
        return end if self._deadline is None else min(self._deadline, end)

    def join(self, timeout: float | None = None) -> list[Any]:  # pragma: no cover - abstract
        raise NotImplementedError


class _ProcessContext(SpawnContext):
    def __init__(self, procs: list, conns: list, timeout: float | None) -> None:
        super().__init__(len(procs), timeout)
        self.processes = procs
        self._conns = conns

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def _stop_all(self) -> None:
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        end = time.monotonic() + 2.0
        for p in self.processes:
            p.join(max(0.0, end - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1.0)

    def join(self, timeout: float | None = None) -> list[Any]:
        """Wait for every rank; their return values in rank order, or the first failure."""
        deadline = self._join_deadline(timeout)
        pending = set(range(self.nprocs)) - set(self._results)
        by_conn = {self._conns[r]: r for r in pending}
        by_sentinel = {self.processes[r].sentinel: r for r in pending}
        try:
            while pending:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready = multiprocessing.connection.wait(
                    [self._conns[r] for r in pending]
                    + [self.processes[r].sentinel for r in pending], left)
                if not ready and deadline is not None and time.monotonic() >= deadline:
                    raise self._timeout_error(list(pending))
                conns = [o for o in ready if o in by_conn]
                exits = [o for o in ready if o in by_sentinel and by_sentinel[o] in pending]
                for conn in conns:
                    rank = by_conn[conn]
                    if rank in pending:
                        self._receive(rank, conn)
                        pending.discard(rank)
                for sentinel in exits:
                    rank = by_sentinel[sentinel]
                    if rank not in pending:
                        continue
                    conn = self._conns[rank]
                    if conn.poll(0):
                        self._receive(rank, conn)
                        pending.discard(rank)
                        continue
                    self.processes[rank].join(0)
                    _raise_failure(rank, None, self.processes[rank].exitcode)
        except BaseException:
            self._stop_all()
            raise
        end = time.monotonic() + _EXIT_GRACE
        for p in self.processes:
            p.join(max(0.0, end - time.monotonic()))
        self._stop_all()  # anything still alive after returning its value
        return [self._results[r] for r in range(self.nprocs)]

    def _receive(self, rank: int, conn: multiprocessing.connection.Connection) -> None:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            self.processes[rank].join(1.0)
            _raise_failure(rank, None, self.processes[rank].exitcode)
        outcome = _decode(message)
        if outcome[0] != "ok":
            _raise_failure(rank, outcome, None)
        self._results[rank] = outcome[1]


class _ThreadContext(SpawnContext):
    def __init__(self, fn: Callable[..., Any], args: tuple, nprocs: int, port: int,
                 timeout: float | None) -> None:
        super().__init__(nprocs, timeout)
        self.contexts = [RankContext(_rank_env(r, nprocs, port)) for r in range(nprocs)]
        self._outcomes: dict[int, tuple] = {}  # live objects: a thread-rank needs no pickle
        self._order: list[int] = []  # ranks in the order they finished
        self._done = threading.Condition()
        self.threads = [
            threading.Thread(target=self._run, args=(fn, r, args), daemon=True,
                             name=f"spmd-rank-{r}")
            for r in range(nprocs)
        ]
        for t in self.threads:
            t.start()

    def _run(self, fn: Callable[..., Any], rank: int, args: tuple) -> None:
        with rank_context(self.contexts[rank]) as ctx:
            outcome = _attempt(fn, rank, args)
            with self._done:  # report before cleaning up: closing may break the others
                self._outcomes[rank] = outcome
                self._order.append(rank)
                self._done.notify_all()
            ctx.close()  # e.g. destroy the process groups this rank left behind

    def _abort_all(self, reason: str) -> None:
        for ctx in self.contexts:
            ctx.abort(reason)

    def join(self, timeout: float | None = None) -> list[Any]:
        """Wait for every thread-rank; results in rank order, or the first failure."""
        deadline = self._join_deadline(timeout)
        with self._done:
            while True:
                for rank in self._order:  # the first failure is the cause; later ones follow
                    outcome = self._outcomes[rank]
                    if outcome[0] != "ok":
                        self._abort_all(f"rank {rank} failed")
                        _raise_failure(rank, outcome, None)
                if len(self._outcomes) == self.nprocs:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    pending = set(range(self.nprocs)) - set(self._outcomes)
                    error = self._timeout_error(list(pending))
                    self._abort_all(str(error))
                    raise error
                self._done.wait(left)
        for t in self.threads:  # let each rank finish releasing what it built (close hooks)
            t.join(_EXIT_GRACE)
        return [self._outcomes[r][1] for r in range(self.nprocs)]


def spawn(
    fn: Callable[..., Any],
    args: tuple = (),
    nprocs: int = 2,
    join: bool = True,
    start_method: str = "spawn",
    timeout: float | None = None,
) -> list[Any] | SpawnContext:
    """Run ``fn(rank, *args)`` on ``nprocs`` local ranks; their return values in rank order.

    Args:
        fn: the rank's entry point. With ``"spawn"``/``"forkserver"`` it must be
            importable (defined at module level); ``"thread"`` takes any callable.
        args: extra positional arguments after the rank.
        nprocs: how many ranks.
        join: wait and return the results; False returns a :class:`SpawnContext`.
        start_method: ``"spawn"``, ``"fork"``, ``"forkserver"`` or ``"thread"`` (ranks as
            threads of this process: works in notebooks, where functions cannot be pickled).
        timeout: seconds before ranks still running are stopped and ``DistTimeoutError``
            names them; None waits as long as ranks keep running.

    Raises:
        SpawnError: a rank raised (its traceback is in the message) or exited without
            returning (its exit code); the other ranks are stopped first.

    Example::

        def work(rank):
            dist.init_process_group("gloo")
            t = torch.ones(1) * rank
            dist.all_reduce(t)
            return t

        spawn(work, nprocs=2)  # -> [tensor([1.]), tensor([1.])]
    """
    if not callable(fn):
        raise TypeError(f"spawn fn must be callable, got {type(fn).__name__}")
    if not isinstance(args, tuple):
        raise TypeError(f"spawn args must be a tuple, got {type(args).__name__}")
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"spawn nprocs must be a positive int, got {nprocs!r}")
    if start_method not in _START_METHODS:
        raise ValueError(f"spawn start_method must be one of {_START_METHODS}, got {start_method!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or timeout <= 0):
        raise ValueError(f"spawn timeout must be a positive number of seconds, got {timeout!r}")
    port = free_port()
    context: SpawnContext
    if start_method == "thread":
        context = _ThreadContext(fn, args, nprocs, port, timeout)
    else:
        mp = multiprocessing.get_context(start_method)
        procs, conns = [], []
        for rank in range(nprocs):
            recv, send = mp.Pipe(duplex=False)
            p = mp.Process(target=_child, args=(fn, rank, args, _rank_env(rank, nprocs, port), send),
                           name=f"spmd-rank-{rank}")
            p.start()
            send.close()
            procs.append(p)
            conns.append(recv)
        context = _ProcessContext(procs, conns, timeout)
    return context.join() if join else context
