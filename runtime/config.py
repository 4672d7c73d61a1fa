"""Every tunable of the library, in one place, each with its environment override.

Values are read from the environment when they are asked for, so a test or a notebook
can change a variable and see the effect without re-importing anything.

=========================  ===============  ================================================
variable                   default          meaning
=========================  ===============  ================================================
``SPMD_STORE_TIMEOUT``     ``300``          seconds a store waits for a key, a peer, a join
``SPMD_AUTH_TOKEN``        unset            shared secret stores and RPC agents demand
``SPMD_STORE_MAX_MESSAGE`` ``1073741824``   largest request a store server accepts (bytes)
``SPMD_TIMEOUT``           ``1800``         seconds a process-group operation may take
``SPMD_DEBUG``             ``off``          ``detail``: ranks compare every collective first
``SPMD_HEARTBEAT_INTERVAL`` ``0.5``         seconds between a rank's liveness beats
``SPMD_SIZE_CHECK``        ``1``            ``0``: collectives skip the size check that
                                            names ranks whose calls disagree (see
                                            ``spmd.runtime.sizecheck``)
``GLOO_SOCKET_IFNAME``     unset            network interface Gloo uses (PyTorch's variable)
``SPMD_KERNELS``           ``auto``         ``torch``: torch reference kernels everywhere;
                                            ``triton``: Triton on CPU too (interpreted); see
                                            ``spmd.kernels.kernels_setting``
``SPMD_BUCKET_CAP_MB``     unset            ``parallelize``'s bucket cap when not passed
``SPMD_COMPILE_COMPUTE``   unset            ``parallelize``'s compile_compute when not passed
``SPMD_RPC_SHUTDOWN_TIMEOUT`` ``1800``      seconds a graceful rpc ``shutdown()`` waits for peers
``SPMD_RPC_RETRY_INTERVAL`` ``1.0``         seconds before an unanswered RRef/cleanup message
                                            is sent again (then 1.5x longer each time)
``SPMD_RPC_HOST``          unset            address the RPC agent binds; default: the local
                                            address that routes to the store's host
``SPMD_RPC_CMA``           ``1``            ``0``: never read large tensors straight from a
                                            same-host peer's memory (process_vm_readv)
``SPMD_RPC_CMA_THRESHOLD`` ``3145728``      bytes from which a tensor buffer is read that way
``SPMD_VERIFY``            ``0``            ``1``: check every planned graph (placements,
                                            local shapes, gradients reduced, each decision
                                            on real shards); ``structure``: all but the
                                            real shards. See ``spmd.lowering.verify``
``SPMD_HIERARCHICAL``      ``auto``         gradient all-reduces of groups across hosts:
                                            ``auto`` as the cost model prices them,
                                            ``always`` two-level where the group allows,
                                            ``never`` the flat ring
``SPMD_HOST``              unset            this rank's host name, for the topology (see
                                            ``spmd.runtime.topology``)
=========================  ===============  ================================================
"""

from __future__ import annotations

import os
from datetime import timedelta

__all__ = ["store_timeout", "auth_token", "store_max_message", "process_group_timeout",
           "debug_levels", "heartbeat_interval", "size_check", "rpc_shutdown_timeout", "rpc_retry_interval",
           "rpc_bind_host", "rpc_cma_enabled", "rpc_cma_threshold", "rpc_auth_token",
           "verify_plans", "hierarchical"]


def _float_env(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return value


def store_timeout() -> timedelta:
    """Default timeout of every store (``SPMD_STORE_TIMEOUT`` seconds, 300 like PyTorch)."""
    return timedelta(seconds=_float_env("SPMD_STORE_TIMEOUT", 300.0))


def store_reconnect() -> float:
    """Seconds a store client that was connected keeps trying to reach its server again
    (``SPMD_STORE_RECONNECT``, 10): long enough for a server that restarts, short enough
    that the loss of the store's host is named in seconds, not after the store timeout."""
    return _float_env("SPMD_STORE_RECONNECT", 10.0)


def auth_token() -> str | None:
    """The shared secret from ``SPMD_AUTH_TOKEN``, or None when unset or empty."""
    return os.environ.get("SPMD_AUTH_TOKEN") or None


def store_max_message() -> int:
    """Largest request frame a store server accepts (``SPMD_STORE_MAX_MESSAGE`` bytes).

    The cap protects the server from a length prefix that would make it buffer gigabytes;
    it is far above what any real key or value needs (64 MiB values are tested).
    """
    return int(_float_env("SPMD_STORE_MAX_MESSAGE", float(1 << 30)))


def process_group_timeout() -> timedelta:
    """Default timeout of process-group operations (``SPMD_TIMEOUT`` seconds, 30 minutes
    like PyTorch's Gloo groups)."""
    return timedelta(seconds=_float_env("SPMD_TIMEOUT", 1800.0))


def debug_levels(value: str | None = None) -> frozenset[str]:
    """The debug levels in ``value``, or switched on (``SPMD_DEBUG`` as this rank sees it)
    when None; comma-separated, e.g. ``detail``."""
    raw = (_context_getenv("SPMD_DEBUG") or "") if value is None else value
    return frozenset(part.strip().lower() for part in raw.split(",") if part.strip())


def heartbeat_interval() -> float:
    """Seconds between liveness beats (``SPMD_HEARTBEAT_INTERVAL``, 0.5). A dead rank is
    named about 2.5 intervals after a collective fails."""
    return _float_env("SPMD_HEARTBEAT_INTERVAL", 0.5)


def size_check() -> bool:
    """Whether collectives compare their sizes across ranks before moving data
    (``SPMD_SIZE_CHECK``, on; ``0`` turns it off): a disagreement is then a Python error
    naming every rank's call instead of Gloo aborting a process. A small call's check
    rides on its data; a larger one's costs one round trip (``spmd.runtime.sizecheck``)."""
    return (_context_getenv("SPMD_SIZE_CHECK") or "1").strip() != "0"


def _context_getenv(name: str) -> str | None:
    from spmd.runtime.context import getenv  # thread-ranks see their own variables

    return getenv(name)


def rpc_shutdown_timeout() -> float:
    """Seconds ``shutdown(graceful=True)`` waits for every peer (``SPMD_RPC_SHUTDOWN_TIMEOUT``,
    1800 like ``SPMD_TIMEOUT``): a job whose workers finish far apart passes ``timeout=``."""
    return _float_env("SPMD_RPC_SHUTDOWN_TIMEOUT", 1800.0)


def rpc_retry_interval() -> float:
    """Seconds before a control message (RRef protocol, context cleanup) without an answer
    is sent again (``SPMD_RPC_RETRY_INTERVAL``, 1.0 as PyTorch's agent); it backs off 1.5x."""
    return _float_env("SPMD_RPC_RETRY_INTERVAL", 1.0)


def rpc_bind_host() -> str | None:
    """The address the agent binds (``SPMD_RPC_HOST``), or None to derive it."""
    return _context_getenv("SPMD_RPC_HOST") or None


def rpc_cma_enabled() -> bool:
    """Whether same-host peers may read large buffers from each other's memory
    (``SPMD_RPC_CMA``, on unless ``0``)."""
    return (_context_getenv("SPMD_RPC_CMA") or "1").strip() not in ("0", "false", "no", "off")


def rpc_cma_threshold() -> int:
    """Smallest buffer (bytes) a same-host peer reads from our memory instead of receiving
    it over the socket (``SPMD_RPC_CMA_THRESHOLD``, 3 MiB). Below it the socket is faster:
    the release message and a fresh mapping cost ~300 µs; one rpc_sync of a float32
    argument took 583/1275 µs (socket/read) at 1 MiB, 1991/1387 µs at 4 MiB (2-core VM,
    2026-11, /tmp sweep with benchmarks/rpc.py's no-op)."""
    return int(_float_env("SPMD_RPC_CMA_THRESHOLD", float(3 << 20)))


def rpc_auth_token() -> bytes | None:
    """The shared secret (``SPMD_AUTH_TOKEN``, as for stores), UTF-8 encoded, or None."""
    token = _context_getenv("SPMD_AUTH_TOKEN") or auth_token()
    return token.encode("utf-8") if token else None


def verify_plans() -> str | None:
    """Whether every planned graph is verified (``SPMD_VERIFY``): None (``0``, unset),
    ``"all"`` (``1``) or ``"structure"`` (no checks on real shards). This project's tests
    set ``1``; a user sets it to check a new model's plan once, at the cost of planning
    time."""
    raw = (_context_getenv("SPMD_VERIFY") or "").strip().lower()
    if raw in ("", "0", "off", "false", "no"):
        return None
    if raw in ("1", "on", "true", "yes", "all"):
        return "all"
    if raw == "structure":
        return "structure"
    raise ValueError(f"SPMD_VERIFY={raw!r}: expected 0, 1 or structure")


def hierarchical() -> str:
    """``SPMD_HIERARCHICAL``: ``auto`` (default), ``always`` or ``never``."""
    raw = (_context_getenv("SPMD_HIERARCHICAL") or "auto").strip().lower()
    if raw not in ("auto", "always", "never"):
        raise ValueError(f"SPMD_HIERARCHICAL={raw!r}: expected auto, always or never")
    return raw
