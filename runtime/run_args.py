"""The arguments of ``python -m spmd.runtime.run`` (``spmd-run``): torchrun's, with its
spellings (dashes or underscores), checked before anything starts."""

from __future__ import annotations

import argparse
import os
from typing import Sequence

__all__ = ["parse_args"]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _nnodes(text: str) -> tuple[int, int]:
    """``N`` (that many hosts in every round) or torchrun's elastic ``MIN:MAX``."""
    low, _, high = text.partition(":")
    low_n, high_n = _positive(low), _positive(high or low)
    if low_n > high_n:
        raise argparse.ArgumentTypeError(f"{text}: MIN is above MAX")
    return low_n, high_n


def _nproc(text: str) -> int:
    if text in ("auto", "cpu"):
        return os.cpu_count() or 1
    if text == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError("--nproc-per-node gpu: no CUDA device here")
        return torch.cuda.device_count()
    return _positive(text)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The launcher's arguments; torchrun's spellings (dashes or underscores) are accepted.
    ``--nnodes MIN:MAX`` gives ``min_nodes`` MIN and ``nnodes`` MAX (both N for ``N``)."""
    parser = argparse.ArgumentParser(
        prog="python -m spmd.runtime.run",
        description="Start a job's local ranks on this host (torchrun-compatible arguments).")
    add = parser.add_argument
    add("--nnodes", type=_nnodes, default=(1, 1),
        help="number of hosts, or an elastic range MIN:MAX: a round starts once MAX hosts "
             "have joined, or at least MIN and no more for --join-last-call seconds "
             "(default 1)")
    add("--node-rank", "--node_rank", type=int, default=None,
        help="this host's index in [0, nnodes) (MAX for a range); a round numbers its hosts "
             "in this order (default: NODE_RANK, GROUP_RANK or 0)")
    add("--nproc-per-node", "--nproc_per_node", type=_nproc, default=1,
        help="ranks on this host: a number, 'cpu'/'auto' (one per core) or 'gpu'")
    add("--master-addr", "--master_addr", default=None,
        help="node rank 0's address, where the store is served (default MASTER_ADDR or "
             "127.0.0.1)")
    add("--master-port", "--master_port", type=int, default=None,
        help="the store's port (default MASTER_PORT or 29500)")
    add("--rdzv-endpoint", "--rdzv_endpoint", default=None,
        help="host:port of the store, instead of --master-addr/--master-port")
    add("--rdzv-backend", "--rdzv_backend", default="static",
        help="accepted for torchrun's command lines: 'static' or 'c10d' (one store either way)")
    add("--rdzv-id", "--rdzv_id", default="none", help="the job's id (TORCHELASTIC_RUN_ID)")
    add("--standalone", action="store_true",
        help="one host, a free port on 127.0.0.1 (no --master-* needed)")
    add("--join-timeout", "--join_timeout", type=float, default=300.0,
        help="seconds node 0 waits for a round's hosts to join, and a host whose ranks have "
             "finished waits for the others' (default 300)")
    add("--join-last-call", "--join_last_call", type=float, default=5.0,
        help="with --nnodes MIN:MAX, seconds without a new host, once MIN have joined, "
             "before a round starts with fewer than MAX (default 5)")
    add("--agent-timeout", "--agent_timeout", type=float, default=15.0,
        help="seconds without a beat from another host's agent, while a round runs, "
             "before the round ends naming that host (default 15)")
    add("--max-restarts", "--max_restarts", type=_non_negative, default=0,
        help="times to start the whole group again after a rank fails (default 0); ranks "
             "read the count so far in TORCHELASTIC_RESTART_COUNT")
    add("--local-addr", "--local_addr", default=None,
        help="this host's address that the others reach (default: the one routed to the "
             "master)")
    add("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    add("--no-python", "--no_python", action="store_true",
        help="run the script as a program, not with this python")
    add("script", help="the training script (or module with -m, program with --no-python)")
    add("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    args.min_nodes, args.nnodes = args.nnodes
    if args.module and args.no_python:
        parser.error("-m and --no-python are exclusive")
    if args.rdzv_backend not in ("static", "c10d", "spmd"):
        parser.error(f"--rdzv-backend {args.rdzv_backend!r}: expected static, c10d or spmd")
    if args.standalone:
        if args.nnodes != 1:
            parser.error("--standalone is one host; drop --nnodes or --standalone")
        from spmd.runtime.launch import free_port

        args.master_addr, args.master_port, args.rdzv_endpoint = "127.0.0.1", free_port(), None
    if args.rdzv_endpoint is not None:
        if args.master_addr is not None or args.master_port is not None:
            parser.error("give --rdzv-endpoint or --master-addr/--master-port, not both")
        host, sep, port = args.rdzv_endpoint.rpartition(":")
        if not sep or not host or not port.isdigit():
            parser.error(f"--rdzv-endpoint must be host:port, got {args.rdzv_endpoint!r}")
        args.master_addr, args.master_port = host, int(port)
    if args.master_addr is None:
        args.master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if args.master_port is None:
        args.master_port = int(os.environ.get("MASTER_PORT", "29500"))
    if not 1 <= args.master_port <= 65535:
        parser.error(f"--master-port must be in [1, 65535], got {args.master_port}")
    if args.node_rank is None:
        args.node_rank = int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")))
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank {args.node_rank} is outside [0, {args.nnodes}) for "
                     f"--nnodes {args.nnodes}")
    if args.join_timeout <= 0:
        parser.error(f"--join-timeout must be positive, got {args.join_timeout}")
    if args.agent_timeout <= 0:
        parser.error(f"--agent-timeout must be positive, got {args.agent_timeout}")
    if args.join_last_call < 0:
        parser.error(f"--join-last-call must be 0 or more, got {args.join_last_call}")
    if args.script_args[:1] == ["--"]:
        args.script_args = args.script_args[1:]
    return args
