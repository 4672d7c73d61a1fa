"""What every benchmark here shares, so that a benchmark is its workload and its variants.

A script run as ``python benchmarks/x.py`` imports this module as a sibling
(``import harness``; Python puts the script's folder first on ``sys.path``).

Writing a new benchmark::

    \"\"\"One line that says what is measured against what (``--help`` shows it).

        python benchmarks/mine.py [--steps 20] [--rounds 5]

    How it is measured, and what each variant is.
    \"\"\"
    import harness

    def rank_main(rank, steps, rounds):
        with harness.group(rank, torch_group=True) as world:   # torch's group, then ours
            import torch.distributed as tdist
            models = {"spmd": ..., "torch DDP": ...}            # the variants
            batches = ...                                       # the workload
            timed = harness.alternate(
                {v: lambda m=m: train(m, batches) for v, m in models.items()},
                rounds, barrier=tdist.barrier, per=steps)
            return timed.times if rank == 0 else None

    def main():
        args = harness.parser(__doc__, steps=20, rounds=5).parse_args()
        times = harness.spawn(rank_main, args.steps, args.rounds, nprocs=2)[0]
        harness.table(("variant", "ms/step", "vs torch DDP (x faster)", "spread"), "lrrl")
        for variant, v in harness.versus(times, "torch DDP").items():
            harness.row(variant, f"{v.median * 1e3:.2f}", f"{v.ratio:.2f}", v.spread)

The project's rule for measuring (DESIGN.md, "Testing and measuring"): variants alternate
within each round so all of them see the same machine; the warm-up round (compiling)
is not counted; a variant's figure is the median over rounds, reported as a ratio against
a peer measured in the same run (torch DDP, FSDP2, Gloo, TensorPipe...), with the
spread of the per-round ratios. :func:`alternate` runs the rounds, :func:`versus` makes
the figures, :func:`table` and :func:`row` print the markdown tables BENCHMARKS.md
quotes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

# -- the command line ---------------------------------------------------------------------


def parser(doc: str, *, steps: int | None = None, rounds: int | None = None
           ) -> argparse.ArgumentParser:
    """An argument parser described by the first line of the benchmark's docstring, with
    ``--steps`` (steps a round) and ``--rounds`` (rounds counted, after the warm-up) when
    given their defaults."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    if steps is not None:
        p.add_argument("--steps", type=int, default=steps)
    if rounds is not None:
        p.add_argument("--rounds", type=int, default=rounds)
    return p


def choices(text: str, known: Sequence[str], parser: argparse.ArgumentParser,
            what: str = "case") -> list[str]:
    """The comma-separated names in ``text``, each one of ``known`` (else a usage error)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown {what}(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return names


def world_sizes(text: str, parser: argparse.ArgumentParser, flag: str = "--nprocs"
                ) -> list[int]:
    """The comma-separated world sizes in ``text``, each 2 or more (else a usage error)."""
    sizes = [int(s) for s in text.split(",") if s.strip()]
    if not sizes or min(sizes) < 2:
        parser.error(f"{flag}: world sizes of 2 or more")
    return sizes


# -- ranks --------------------------------------------------------------------------------


def spawn(fn: Callable[..., Any], *args: Any, nprocs: int = 2, timeout: float = 6000,
          start_method: str = "spawn") -> list[Any]:
    """``fn(rank, *args)`` on ``nprocs`` local ranks (``spmd.runtime.spawn``), Gloo on the
    loopback interface unless ``GLOO_SOCKET_IFNAME`` says otherwise; the ranks' results in
    rank order."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from spmd.runtime import spawn as run

    return run(fn, args=args, nprocs=nprocs, start_method=start_method, timeout=timeout)


@contextlib.contextmanager
def group(rank: int, *, timeout_s: float = 600, torch_group: bool = False,
          threads: int | None = 1) -> Iterator[int]:
    """A rank's process groups for the ``with`` block; yields the world size.

    ``threads``: torch's compute threads (one per rank: ranks share the machine's cores;
    None leaves torch's default). ``torch_group``: torch.distributed's own Gloo group on
    its own connections (``MASTER_PORT + 1``), made first: made after ours, torch would
    share our group, as DDP users do not. Without it torch.distributed sees the group
    spmd makes (FSDP2, DTensor and the pipelining schedules run over it)."""
    import torch
    import torch.distributed as tdist

    from spmd import runtime as dist

    if threads is not None:
        torch.set_num_threads(threads)
    if torch_group:
        port = int(os.environ["MASTER_PORT"]) + 1
        tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                 world_size=int(os.environ["WORLD_SIZE"]),
                                 timeout=timedelta(seconds=timeout_s))
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        yield dist.get_world_size()
    finally:
        if torch_group:
            tdist.destroy_process_group()
        dist.destroy_process_group()


# -- rounds -------------------------------------------------------------------------------


def in_turn(names: list[str], r: int) -> list[str]:
    """Every round in the same order."""
    return names


def rotated(names: list[str], r: int) -> list[str]:
    """Round ``r`` starts at the ``r``-th variant (each is first as often as the others)."""
    k = r % len(names)
    return names[k:] + names[:k]


def back_and_forth(names: list[str], r: int) -> list[str]:
    """Even rounds in order, odd rounds reversed (a, b, b, a, a, b...)."""
    return names if r % 2 == 0 else names[::-1]


@dataclass(frozen=True, kw_only=True, slots=True)
class Rounds:
    """What :func:`alternate` measured. ``times``: each variant's seconds per round
    (divided by ``per``), counted rounds only; ``results``: what each counted run
    returned; ``warmup``: what the variant's last warm-up run returned."""

    times: dict[str, list[float]]
    results: dict[str, list[Any]]
    warmup: dict[str, Any]


def alternate(variants: dict[str, Callable[[], Any]], rounds: int, *, warmup: int = 1,
              per: int = 1, barrier: Callable[[], Any] | None = None,
              order: Callable[[list[str], int], list[str]] = in_turn,
              before: Callable[[str], Any] | None = None,
              after: Callable[[str, int], Any] | None = None) -> Rounds:
    """Run every variant once a round, alternating within the round, for ``warmup``
    rounds that are not counted (compiling) and then ``rounds`` that are.

    Each run is ``before(name)`` (untimed), ``barrier()`` (every rank starts the
    variant together), then the timed call ``variants[name]()``, then ``after(name,
    round)`` (untimed; round ``warmup`` is the first counted). ``per``: what a round's
    time is divided by (its steps or calls). ``order``: the variants' order in round
    ``r`` (:func:`in_turn`, :func:`rotated`, :func:`back_and_forth`).
    """
    names = list(variants)
    times: dict[str, list[float]] = {v: [] for v in names}
    results: dict[str, list[Any]] = {v: [] for v in names}
    first: dict[str, Any] = {}
    for r in range(warmup + rounds):
        for name in order(names, r):
            if before is not None:
                before(name)
            if barrier is not None:
                barrier()
            start = time.perf_counter()
            result = variants[name]()
            seconds = (time.perf_counter() - start) / per
            if r >= warmup:
                times[name].append(seconds)
                results[name].append(result)
            else:
                first[name] = result
            if after is not None:
                after(name, r)
    return Rounds(times=times, results=results, warmup=first)


# -- figures ------------------------------------------------------------------------------


def ratios(top: Sequence[float], bottom: Sequence[float]) -> list[float]:
    """Round by round, ``top`` over ``bottom``."""
    return [a / b for a, b in zip(top, bottom)]


def span(values: Sequence[float], fmt: str = ".2f", sep: str = "–") -> str:
    """The lowest and the highest of ``values``: ``"0.97–1.12"``."""
    return f"{min(values):{fmt}}{sep}{max(values):{fmt}}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Versus:
    """A variant against the peer: ``median`` seconds over rounds, ``ratio`` the peer's
    median over this one's (above 1: faster than the peer), ``spread`` the lowest and
    highest per-round ratio (empty for the peer itself)."""

    median: float
    ratio: float
    spread: str


def versus(times: dict[str, list[float]], peer: str) -> dict[str, Versus]:
    """Each variant's figures against ``peer``'s, measured in the same rounds."""
    base = times[peer]
    out = {}
    for variant, samples in times.items():
        t = statistics.median(samples)
        out[variant] = Versus(median=t, ratio=statistics.median(base) / t,
                              spread="" if variant == peer else span(ratios(base, samples)))
    return out


# -- the report ---------------------------------------------------------------------------


def table(columns: Sequence[str], align: str) -> None:
    """Print a markdown table's header: ``columns``, each aligned by its letter in
    ``align`` (``l`` left, ``r`` right)."""
    if len(columns) != len(align):
        raise ValueError(f"{len(columns)} columns, {len(align)} alignments")
    row(*columns)
    print("|" + "".join("---:|" if a == "r" else "---|" for a in align))


def row(*cells: Any, flush: bool = False) -> None:
    """Print a markdown table's row."""
    print("| " + " | ".join(str(c) for c in cells) + " |", flush=flush)
