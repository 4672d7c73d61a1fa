"""Every strategy across hosts equals one process (float64, 3 AdamW steps): on 2
loopback hosts x 2 ranks (``SPMD_HOST``) here, with gradient all-reduces forced two-level
and forced flat; across network namespaces under the launcher in tests/cpu/test_hosts.py."""

from __future__ import annotations

import os

import pytest
import torch

from spmd import runtime as dist
from tests import across_hosts

HOSTS = ["h0", "h0", "h1", "h1"]


def _job(rank: int, layouts: list[str], mode: str) -> dict:
    os.environ["SPMD_HIERARCHICAL"] = mode
    return across_hosts.run(rank, layouts, HOSTS)


@pytest.mark.parametrize("mode", ["always", "never"])
def test_data_parallel_across_hosts_equals_one_process_in_two_levels_and_flat(mode):
    layouts = ["ddp", "zero1", "fsdp", "zero2"]
    results = dist.spawn(_job, args=(layouts, mode), nprocs=4, start_method="forkserver",
                         timeout=110)
    across_hosts.check(results, layouts)
    for out in results:
        algorithms = {(kind, a) for layout in layouts for kind, a in out[layout]["buckets"]}
        kinds = {"all_reduce", "all_gather", "reduce_scatter"}  # every kind, each bucket
        expect = "hierarchical" if mode == "always" else "native"
        assert algorithms == {(kind, expect) for kind in kinds}
        summary = out["ddp"]["summary"]
        assert "hosts: 2 host(s) (SPMD_HOST); h0: ranks 0-1; h1: ranks 2-3" in summary
        assert "mesh dimension 'dp' crosses 2 hosts" in summary
        assert "probed at start-up over 2 hosts" in summary
        # each layout times, at start-up, the kinds of collective its data dimension runs
        assert "flat and two-level all-reduces timed" in summary
        assert ("flat and two-level all-reduces, all-gathers, reduce-scatters timed"
                in out["fsdp"]["summary"])


@pytest.mark.parametrize("layouts", [["hsdp", "tp"], ["pp", "cp", "auto"]], ids="-".join)
def test_every_other_strategy_across_hosts_equals_one_process(layouts):
    results = dist.spawn(_job, args=(layouts, "auto"), nprocs=4, start_method="forkserver",
                         timeout=110)
    across_hosts.check(results, layouts)


# the loops users write (tests/cpu/test_training_loops.py) on 4 ranks of 2 loopback hosts,
# every bucket two-level: batch sizes that change (two families), accumulation over step
# calls, a train and an eval step on one model; each batch divides by the 4 ranks
LOOPS = [("changing_batch", "ddp"), ("changing_batch_encoder", "fsdp"),
         ("step_accumulation_over_calls", "zero2"), ("two_step_functions", "fsdp")]
SIZES = (16, 8, 4, 12)


def _loops(rank: int, cases: list[tuple[str, str]]) -> dict:
    from datetime import timedelta

    from tests.cpu import test_training_loops as loops

    os.environ["SPMD_HOST"], os.environ["SPMD_HIERARCHICAL"] = HOSTS[rank], "always"
    loops.WORLD, loops.SIZES = 4, SIZES
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    try:
        return {case: loops.LOOPS[case[0]][0](rank, case[1])[0] for case in cases}
    finally:
        dist.destroy_process_group()


def test_the_loops_users_write_across_hosts_in_two_levels(monkeypatch):
    from tests.cpu import test_training_loops as loops

    monkeypatch.setattr(loops, "SIZES", SIZES)  # (one process on the whole batch)
    results = dist.spawn(_loops, args=(LOOPS,), nprocs=4, start_method="forkserver",
                         timeout=110)
    for name, strategy in LOOPS:
        expected, _ = loops.LOOPS[name][0](None, strategy)
        for rank, out in enumerate(results):
            for key, value in expected.items():
                got = out[(name, strategy)][key]
                assert torch.allclose(got, value, rtol=1e-12, atol=1e-12), (
                    name, strategy, rank, key, (got - value).abs().max().item())
