"""Faults across hosts (network namespaces on shaped links, tests/hosts.py): a link that
drops 5% of its packets, a host cut off mid-step, a rank that stalls past the timeout.
Each job is tests/checkpoint_job.py (fsdp, 6 steps, a checkpoint every 2, float64) on 2
hosts of one rank each under ``python -m spmd.runtime.run --nnodes 1:2
--max-restarts 1``: no hang, the fault named, and the run finished equal to one never
interrupted (bit for bit on the same ranks; to 1e-12 where it continues on fewer)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from tests import hosts as harness
from tests.cpu.test_checkpoint_manager import RANKS, _results, _straight
from tests.hosts import Hosts, Link

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WHY = harness.unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no simulated hosts here: {WHY}")
LINK = Link(gbps=1, latency_ms=0.2)


def _job(hosts: Hosts, out, kill: str = "", timeout: float = 60, strategy: str = "fsdp"):
    """Both hosts' agents (their stderr), the job's ranks binding the host's eth0; hsdp
    on 2 ranks a host (sharded within, replicated across), the others on one."""
    per = RANKS.get(strategy, 2) // 2
    common = ["--nnodes", "1:2", "--nproc-per-node", str(per), "--master-addr", hosts.address(0),
              "--master-port", "29500", "--max-restarts", "1", "--join-last-call", "1",
              "--join-timeout", "15"]
    job = [os.path.join(REPO, "tests", "checkpoint_job.py"), str(out), "--strategy", strategy,
           "--steps", "6", "--every", "2", "--timeout", str(timeout)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, GLOO_SOCKET_IFNAME="eth0")
    return [hosts.popen(node, [sys.executable, "-m", "spmd.runtime.run", "--node-rank",
                               str(node), *common, *job, *(["--kill", kill] if kill else [])],
                        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                        text=True)
            for node in (0, 1)]


def _wait_for(path, seconds: float = 90) -> None:
    """Until ``path`` exists (the job writes it), at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)  # polling a file the job writes, not ordering by time


def _equal(out, straight, world, whole=2):
    for a, b in zip(_results(straight, whole), _results(out, world)):
        assert a["step"] == b["step"] == 6 and a["lr"] == b["lr"]
        for key in a["model"]:
            if world == whole:
                assert torch.equal(a["model"][key], b["model"][key]), key
            else:
                torch.testing.assert_close(b["model"][key], a["model"][key], rtol=0,
                                           atol=1e-12)


def test_a_link_that_drops_5_percent_of_packets_only_slows_the_job(tmp_path,
                                                                   tmp_path_factory):
    straight = _straight("fsdp", tmp_path_factory)
    out = tmp_path / "lossy"
    out.mkdir()
    with Hosts(2, link=Link(gbps=1, latency_ms=0.2, loss=0.05)) as hosts:
        agents = _job(hosts, out)
        errs = [a.communicate(timeout=110)[1] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], errs
    assert (out / "attempts.txt").read_text().split("\n")[:1] == ["0 0 2"]  # no restart
    _equal(out, straight, 2)


def test_a_host_cut_off_mid_step_is_named_and_the_job_continues_on_the_rest(
        tmp_path, tmp_path_factory):
    straight = _straight("fsdp", tmp_path_factory)
    out = tmp_path / "cut"
    out.mkdir()
    with Hosts(2, link=LINK) as hosts:
        agents = _job(hosts, out, kill="3:partition:1", timeout=10)
        _wait_for(out / "partition-me")
        hosts.shape(1, Link(gbps=1, latency_ms=0.2, down=True))  # host 1 cut off
        (out / "partitioned").touch()
        errs = [a.communicate(timeout=110)[1] for a in agents]
    assert agents[0].returncode == 0, errs[0][-3000:]
    assert "restarting the job (restart 1 of 1) after rank 0" in errs[0]
    assert "rank 1 (at collective" in errs[0] and "did not take part" in errs[0]
    # the store named, and no second job: alone of two, host 1 elects no store of its own
    assert agents[1].returncode != 0 and "the store's host (node 0 at" in errs[1]
    assert "not more than half: no new store" in errs[1]
    assert (out / "attempts.txt").read_text().split("\n")[:2] == ["0 0 2", "1 2 1"]
    _equal(out, straight, 1)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp", "hsdp", "tp", "pp"])
def test_a_rank_that_stalls_past_the_timeout_is_named_and_restarted(strategy, tmp_path,
                                                                    tmp_path_factory):
    straight = _straight(strategy, tmp_path_factory)
    world = RANKS.get(strategy, 2)
    out = tmp_path / "stall"
    out.mkdir()
    with Hosts(2, link=LINK) as hosts:
        agents = _job(hosts, out, kill=f"3:stall:{world - 1}", timeout=10, strategy=strategy)
        errs = [a.communicate(timeout=110)[1] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], errs
    assert "restarting the job (restart 1 of 1) after rank" in errs[0]
    assert f"rank {world - 1} (at collective" in "".join(errs)  # named by a peer
    assert (out / "attempts.txt").read_text().split("\n")[:2] == [f"0 0 {world}",
                                                                   f"1 2 {world}"]
    _equal(out, straight, world, world)


def test_the_store_hosts_death_on_three_hosts_elects_a_new_one(tmp_path, tmp_path_factory):
    """Three hosts (host 0 serving the store, with 2 ranks; hosts 1 and 2 with one), host
    0's agent and ranks killed at step 3: host 1 serves a new store at its own address,
    host 2 finds it there, and the job restarts on the two, resumes the 4-rank checkpoint
    of step 2 on 2 ranks and finishes the same run (to 1e-12)."""
    straight = _straight("fsdp", tmp_path_factory)
    out = tmp_path / "elected"
    out.mkdir()
    with Hosts(3, link=LINK) as hosts:
        common = ["--nnodes", "2:3", "--master-addr", hosts.address(0), "--master-port",
                  "29500", "--max-restarts", "1", "--join-last-call", "1",
                  "--join-timeout", "30"]
        job = [os.path.join(REPO, "tests", "checkpoint_job.py"), str(out), "--strategy",
               "fsdp", "--steps", "6", "--every", "2", "--timeout", "20", "--kill", "3:host:0"]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, GLOO_SOCKET_IFNAME="eth0")
        agents = [hosts.popen(node, [sys.executable, "-m", "spmd.runtime.run", "--node-rank",
                                     str(node), "--nproc-per-node", str(2 if node == 0 else 1),
                                     *common, *job],
                              cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
                  for node in (0, 1, 2)]
        errs = [a.communicate(timeout=110)[1] for a in agents]
        elected = hosts.address(1)
    assert agents[0].returncode == -9
    assert [a.returncode for a in agents[1:]] == [0, 0], errs
    for err in errs[1:]:
        assert f"node 1 serves the store now at {elected}:29500" in err
    assert (out / "attempts.txt").read_text().split("\n")[:2] == ["0 0 4", "1 2 2"]
    for a, b in zip(_results(straight, 2), _results(out, 2)):  # (4 ranks summed, then 2)
        assert a["step"] == b["step"] == 6 and a["lr"] == b["lr"]
        for key in a["model"]:
            torch.testing.assert_close(b["model"][key], a["model"][key], rtol=0, atol=1e-12)
