"""Rendezvous: from an ``init_method`` URL to a store, this process's rank and the world size.

Three schemes, as in ``torch.distributed``:

- ``tcp://host:port?rank=R&world_size=W``: rank 0 serves a TCPStore at ``host:port``.
- ``file:///path?rank=R&world_size=W``: a FileStore at ``/path``.
- ``env://``: ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` from the
  environment, as torchrun sets them; under Slurm (srun), ``SLURM_PROCID`` and
  ``SLURM_NTASKS`` stand in for ``RANK`` and ``WORLD_SIZE``, and under MPI launchers
  (``mpirun``) ``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE`` (Open MPI) or
  ``PMI_RANK``/``PMI_SIZE`` (MPICH, Intel MPI) do. Under torchrun's agent store
  (``TORCHELASTIC_USE_AGENT_STORE=True``) every rank is a client of the agent's store, and
under ``python -m spmd.runtime.run`` (``SPMD_AGENT_STORE``, the key prefix) of our agent's.

Rank and world size come from the arguments, then the URL's query, then the
environment; two sources that disagree are an error. Everything is checked before any
connection is attempted.
"""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import parse_qs, urlsplit

from spmd.runtime import config
from spmd.runtime.context import getenv
from spmd.runtime.errors import InvalidArgumentError
from spmd.runtime.store.base import Store, as_seconds
from spmd.runtime.store.file_store import FileStore
from spmd.runtime.store.prefix_store import PrefixStore
from spmd.runtime.store.tcp_store import TCPStore

__all__ = ["rendezvous"]

_QUERY_KEYS = {"rank", "world_size", "use_libuv"}  # use_libuv: PyTorch's, accepted, unused


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be an integer, got {text!r}") from None


class NodeArgumentsError(InvalidArgumentError, AssertionError):
    """rank or world_size given both as an argument and in the URL: a ``ValueError`` like
    our other bad arguments, and the ``AssertionError`` torch's ``rendezvous`` raises."""


def _pick(name: str, arg: int | None, query: dict[str, str], env: tuple[str, ...],
          url: str, required: bool = True) -> int | None:
    """One of rank/world_size from the argument, the query or the environment (None when
    none gives it and it is not ``required``)."""
    sources = []
    if arg is not None:
        if not isinstance(arg, int) or isinstance(arg, bool):
            raise TypeError(f"{name} must be an int, got {type(arg).__name__}")
        sources.append((arg, f"the {name}= argument"))
    if name in query:
        sources.append((_int(query[name], f"{name} in {url!r}"), f"the URL's ?{name}="))
    if len(sources) == 2:  # torch refuses this even when the two agree
        raise NodeArgumentsError(
            f"rendezvous: {name} is {sources[0][0]} from {sources[0][1]} and "
            f"{sources[1][0]} from {sources[1][1]}: the url {url!r} has node-specific "
            f"arguments (rank, world_size) already; give them one way"
        )
    if sources:
        return sources[0][0]
    for var in env:
        if getenv(var):
            return _int(getenv(var), f"environment variable {var}")
    if not required:
        return None
    if env:
        names = " (nor " + ", ".join(env[1:]) + ")" if len(env) > 1 else ""
        raise ValueError(
            f"rendezvous {url!r}: environment variable {env[0]} is not set{names}; set it "
            f"or pass {name}= (environment variable {env[0]} expected)"
        )
    what = "rank" if name == "rank" else "size"
    raise ValueError(f"rendezvous {url!r}: {name} is missing ({what} parameter missing); "
                     f"add ?{name}= or pass {name}=")


def _env(var: str, url: str) -> str:
    value = getenv(var)
    if not value:
        raise ValueError(f"rendezvous {url!r}: environment variable {var} is not set")
    return value


def _port(text: str, what: str) -> int:
    port = _int(text, what)
    if not 1 <= port <= 65535:
        raise ValueError(f"{what} must be in [1, 65535], got {port}")
    return port


def rendezvous(
    init_method: str,
    rank: int | None = None,
    world_size: int | None = None,
    timeout: timedelta | None = None,
) -> "Rendezvous":
    """Meet the other processes of a job; returns ``(store, rank, world_size)`` (which
    ``next()`` also gives, as torch's rendezvous iterator does).

    Args:
        init_method: ``tcp://host:port``, ``file:///path`` or ``env://`` (see module doc).
        rank: this process's rank in ``[0, world_size)``.
        world_size: how many processes take part.
        timeout: how long the store waits for the others (default ``SPMD_STORE_TIMEOUT``).

    Raises:
        ValueError: a malformed URL, an unknown scheme, a missing variable, a rank
            outside ``[0, world_size)`` or a non-positive world size; before any I/O.

    Example::

        store, rank, world = rendezvous("tcp://127.0.0.1:29500", rank=0, world_size=2)
    """
    return _rendezvous(init_method, rank, world_size, timeout, need_world_size=True)


def _rendezvous(
    init_method: str,
    rank: int | None,
    world_size: int | None,
    timeout: timedelta | None,
    need_world_size: bool,
) -> "Rendezvous":
    """:func:`rendezvous`; with ``need_world_size`` False, ``world_size`` may stay None
    (a dynamic RPC group: its store is made for no fixed number of participants)."""
    if not isinstance(init_method, str):
        raise TypeError(f"init_method must be a str URL, got {type(init_method).__name__}")
    if timeout is not None:
        as_seconds(timeout)
    url = init_method
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("tcp", "file", "env"):
        raise InvalidArgumentError(
            f"No rendezvous handler for {scheme}:// (rendezvous: unknown scheme in {url!r}; "
            f"expected tcp://host:port, file:///path or env://)"
        )
    try:
        query = {k: v[-1] for k, v in parse_qs(parts.query, strict_parsing=bool(parts.query)).items()}
    except ValueError:
        raise ValueError(f"rendezvous: malformed query string in {url!r}") from None
    unknown = set(query) - _QUERY_KEYS
    if unknown:
        raise ValueError(f"rendezvous: unknown parameter(s) {sorted(unknown)} in {url!r}")

    agent_store = False
    our_agent = None
    if scheme == "env":
        rank = _pick("rank", rank, query,
                     ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"), url)
        world_size = _pick("world_size", world_size, query,
                           ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"),
                           url, need_world_size)
        host = _env("MASTER_ADDR", url)
        port = _port(_env("MASTER_PORT", url), "MASTER_PORT")
        agent_store = getenv("TORCHELASTIC_USE_AGENT_STORE") == "True"
        our_agent = getenv("SPMD_AGENT_STORE")
    else:
        rank = _pick("rank", rank, query, (), url)
        world_size = _pick("world_size", world_size, query, (), url, need_world_size)
    assert rank is not None
    if world_size is None:  # a dynamic group: any rank of its own
        if rank < 0:
            raise ValueError(f"rendezvous {url!r}: rank must be non-negative, got {rank}")
    elif world_size < 1:
        raise ValueError(f"rendezvous {url!r}: world_size must be positive, got {world_size}")
    elif not 0 <= rank < world_size:
        raise ValueError(
            f"rendezvous {url!r}: rank {rank} is outside [0, {world_size}) for world_size "
            f"{world_size}"
        )

    store: Store
    if scheme == "tcp":
        try:
            host, raw_port = parts.hostname, parts.port
        except ValueError:
            raise ValueError(f"rendezvous: malformed port in {url!r}") from None
        if not host or raw_port is None:
            missing = "host" if not host else "port number"
            raise ValueError(f"rendezvous: {url!r} needs a host and a port: tcp://host:port "
                             f"({missing} missing)")
        port = _port(str(raw_port), f"port in {url!r}")
        store = TCPStore(host, port, world_size, rank == 0, timeout, multi_tenant=True,
                         rank=rank)
    elif scheme == "file":
        if parts.netloc or not parts.path:
            raise ValueError(
                f"rendezvous: {url!r} must name an absolute path: file:///path/to/file"
                + ("" if parts.path else " (path missing)")
            )
        store = FileStore(parts.path, world_size, timeout)
    elif our_agent:  # spmd.runtime.run's agent serves the store; every rank is a client
        store = PrefixStore(our_agent, TCPStore(host, port, world_size, False, timeout,
                                                rank=rank))
    elif agent_store:
        from spmd.runtime.store.torch_adapter import TorchStore
        import torch.distributed as tdist

        wait = timedelta(seconds=as_seconds(config.store_timeout() if timeout is None else timeout))
        client = tdist.TCPStore(host, port, world_size, False, wait)
        attempt = getenv("TORCHELASTIC_RESTART_COUNT", "0")
        store = PrefixStore(f"spmd/{attempt}", TorchStore(client))
    else:
        store = TCPStore(host, port, world_size, rank == 0, timeout, multi_tenant=True,
                         rank=rank)
    return Rendezvous((store, rank, world_size))


class Rendezvous(tuple):
    """``(store, rank, world_size)``, unpacked directly, or, as torch's ``rendezvous``
    returns an iterator, taken with ``next()`` (once)."""

    _taken = False

    def __next__(self) -> tuple:
        if self._taken:
            raise StopIteration
        self._taken = True
        return tuple(self)
