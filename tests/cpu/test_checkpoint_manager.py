"""spmd.checkpoint.CheckpointManager: asynchronous, atomic checkpoints every N steps, the
last k kept, resumed bit for bit on the same layout and resharded onto another; partial
and corrupt checkpoints never read; a rank killed with SIGKILL at each point of a step
under ``torchrun --max-restarts`` (tests/checkpoint_job.py) finishes equal to a run
never interrupted."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch

import spmd
from spmd import runtime as dist
from spmd.checkpoint import CheckpointError, CheckpointManager, check_checkpoint
from tests import checkpoint_job as job

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train(net, opt, sched, position, ckpt, steps, rank=0, world=1):
    """tests/checkpoint_job.py's loop: batch by step, noise from the global generator."""
    while position.step < steps:
        step = position.step + 1
        x, y = job.batch(step)
        x = x + 1e-3 * torch.randn_like(x)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        (net(x) - y).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        position.step = step
        if ckpt is not None:
            ckpt.save(step)


def _fresh(strategy=None):
    net = job.model()
    if strategy is not None:
        net = spmd.parallelize(net, strategy=strategy)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return net, opt, sched, job.Position()


def _whole(net):
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


# -- on several ranks ------------------------------------------------------------------


def _ranks(rank, directory, strategy, steps, resume, mode):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    world = dist.get_world_size()
    net, opt, sched, position = _fresh(strategy)
    ckpt = CheckpointManager(directory, net, opt, scheduler=sched, dataloader=position,
                             every=2, keep=2)
    try:
        start = ckpt.restore() if resume else None
        if start is not None:
            position.step = start  # (restored already: checked below)
        if mode == "broken" and rank == 0:  # the directory replaced by a file
            shutil.rmtree(directory)
            open(directory, "w").close()
        dist.barrier()
        error = ""
        try:
            _train(net, opt, sched, position, ckpt, steps, rank, world)
            ckpt.close()
        except CheckpointError as e:
            error = str(e)
        return {"params": _whole(net), "start": start, "error": error,
                "steps": ckpt.all_steps() if mode != "broken" else [],
                "lr": sched.get_last_lr(), "stats": [s.step for s in ckpt.stats]}
    finally:
        dist.destroy_process_group()


def _spawn(*args, nprocs=2):
    return dist.spawn(_ranks, args=args, nprocs=nprocs, start_method="forkserver", timeout=110)


def test_a_resumed_run_is_the_uninterrupted_one_bit_for_bit_and_reshards(tmp_path):
    """fsdp on 2 ranks: 6 steps straight, against 3 steps then a new job resuming (from
    the checkpoint after step 2: every 2, the write of step 2 waited for at step 4 never
    came); the same, resumed in one process on the plain model (resharded: equal to
    1e-12, the gradient's sum taken in another order)."""
    straight = _spawn(str(tmp_path / "a"), "fsdp", 6, False, "")
    _spawn(str(tmp_path / "b"), "fsdp", 3, False, "")
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    resumed = _spawn(str(tmp_path / "b"), "fsdp", 6, True, "")
    for a, b in zip(straight, resumed):
        assert b["start"] == 2
        assert a["lr"] == b["lr"]
        assert a["params"].keys() == b["params"].keys()
        for key in a["params"]:
            assert torch.equal(a["params"][key], b["params"][key]), key
    assert straight[0]["steps"] == [4, 6]  # keep=2
    net, opt, sched, position = _fresh()
    with CheckpointManager(tmp_path / "c", net, opt, scheduler=sched, dataloader=position,
                           every=2) as ckpt:
        assert ckpt.restore() == 2 and position.step == 2
        _train(net, opt, sched, position, ckpt, 6)
    for key, value in _whole(net).items():
        torch.testing.assert_close(value, straight[0]["params"][key], rtol=0, atol=1e-12)
    assert sched.get_last_lr() == straight[0]["lr"]


def test_a_failed_write_is_every_ranks_error_and_nobody_waits(tmp_path):
    results = _spawn(str(tmp_path / "ckpt"), "ddp", 2, False, "broken")
    for out in results:
        assert "could not make" in out["error"] and "step-00000002.partial" in out["error"]


def _draws(rank, strategies):
    """Whether each layout's first step (trace, plan, the forward timed on random
    inputs) leaves the global generator as it was."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        same = {}
        for strategy in strategies:
            net, _ = job._parallel(spmd, strategy, dist.get_world_size())
            x, y = job.batch(1)
            before = torch.get_rng_state()
            if strategy == "pp":
                net.step(x, y, lambda out, t: (out - t).square().mean())
            else:
                (net(x) - y).square().mean().backward()
            same[strategy] = torch.equal(before, torch.get_rng_state())
        return same
    finally:
        dist.destroy_process_group()


def test_planning_leaves_the_users_random_generators_alone():
    """A run resumed from a checkpoint plans at its first step after the generators
    were restored: planning must draw nothing from them (tensor parallelism's forward
    timing drew its random inputs from the global generator)."""
    strategies = ["ddp", "fsdp", "tp", "pp"]
    for out in dist.spawn(_draws, args=(strategies,), nprocs=2, start_method="forkserver",
                          timeout=110):
        assert out == {s: True for s in strategies}


# -- in one process ----------------------------------------------------------------------


def _saved(directory, steps, **options):
    net, opt, sched, position = _fresh()
    with CheckpointManager(directory, net, opt, scheduler=sched, dataloader=position,
                           **options) as ckpt:
        _train(net, opt, sched, position, ckpt, steps)
    return net


def test_partial_and_corrupt_checkpoints_are_never_read(tmp_path, caplog):
    _saved(tmp_path, 3, every=1, keep=None)
    assert sorted(os.listdir(tmp_path)) == ["step-00000001", "step-00000002", "step-00000003"]
    three = tmp_path / "step-00000003"
    data = next(p for p in three.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))  # same size, one byte flipped
    (tmp_path / "step-00000004.partial").mkdir()  # a write that never finished
    (tmp_path / "step-00000005").mkdir()  # a directory without a manifest
    net, opt, sched, position = _fresh()
    ckpt = CheckpointManager(tmp_path, net, opt, scheduler=sched, dataloader=position)
    with caplog.at_level(logging.WARNING, logger="spmd.checkpoint"):
        assert ckpt.restore() == 2
    assert position.step == 2
    assert "step-00000005: no manifest.json" in caplog.text
    assert f"step-00000003: {data.name} is corrupt" in caplog.text
    with pytest.raises(CheckpointError, match=f"{data.name} is corrupt"):
        ckpt.restore(3)
    with open(data, "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match=f"{data.name} has 10 bytes"):
        check_checkpoint(str(three), verify=False)
    (three / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json is unreadable"):
        ckpt.restore(3)
    with pytest.raises(CheckpointError, match="not found"):
        ckpt.restore(7)
    empty = CheckpointManager(tmp_path / "none", net, opt)
    assert empty.restore() is None and empty.latest_step() is None


def test_the_checkpoint_holds_the_state_when_save_was_called(tmp_path):
    """save() copies the state before returning: what the next steps change (here at
    once, in place) is not in the checkpoint being written."""
    net, opt, sched, position = _fresh()
    ckpt = CheckpointManager(tmp_path, net, opt, every=1)
    _train(net, opt, sched, position, None, 1)
    expected = _whole(net)
    assert ckpt.save(1)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    ckpt.close()
    assert ckpt.stats[0].bytes > 0 and ckpt.stats[0].written > 0
    fresh, opt2, _, _ = _fresh()
    assert CheckpointManager(tmp_path, fresh, opt2).restore() == 1
    for key, value in _whole(fresh).items():
        assert torch.equal(value, expected[key]), key
    assert opt2.state_dict()["state"][0]["step"] == 1


class _Branches(torch.nn.Module):
    """A head the loss reaches only from step 3 on (an expert nobody routed to yet, a
    head trained later): at the checkpoint of step 2 its optimizer state does not exist."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.late = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return self.late(h) if step >= 3 else h


def test_a_parameter_without_optimizer_state_yet_resumes_as_it_would_have(tmp_path):
    """Restored where a parameter had no optimizer state yet: it still has none (Adam's
    step count starts where the uninterrupted run's does), not a refusal ("Missing key
    in checkpoint") nor a made-up first step; the run goes on bit for bit."""
    def make():
        torch.manual_seed(0)
        net = _Branches().double()
        return net, torch.optim.AdamW(net.parameters(), lr=0.1)

    def step(net, opt, i):
        g = torch.Generator().manual_seed(i)
        net(torch.randn(3, 4, generator=g, dtype=torch.float64), i).square().mean().backward()
        opt.step()
        opt.zero_grad()

    net, opt = make()
    ckpt = CheckpointManager(tmp_path, net, opt, every=1, async_save=False)
    for i in (1, 2):
        step(net, opt, i)
    ckpt.save(2)
    ckpt.close()
    again, opt2 = make()
    assert CheckpointManager(tmp_path, again, opt2).restore() == 2
    assert again.late.weight not in opt2.state and again.body.weight in opt2.state
    for i in (3, 4):
        step(net, opt, i)
        step(again, opt2, i)
    for (name, a), b in zip(net.named_parameters(), again.parameters()):
        assert torch.equal(a, b), name


def test_only_the_last_k_are_kept_and_partial_leftovers_go(tmp_path):
    (tmp_path / "step-00000001.partial").mkdir(parents=True)
    net = _saved(tmp_path, 8, every=2, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step-00000006", "step-00000008"]
    assert net is not None


def test_a_data_position_per_rank_does_not_carry_to_another_world_size(tmp_path):
    """Saved by 2 ranks at different positions, then read by 1: refused by name."""
    dist.spawn(_positions, args=(str(tmp_path),), nprocs=2, start_method="forkserver",
               timeout=110)
    net, opt, _, position = _fresh()
    with pytest.raises(CheckpointError, match="different positions"):
        CheckpointManager(tmp_path, net, opt, dataloader=position).restore()
    net, opt, _, _ = _fresh()  # without the loader, the rest loads
    assert CheckpointManager(tmp_path, net, opt).restore() == 1


def _positions(rank, directory):
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        net, opt, _, position = _fresh("ddp")
        position.step = 10 + rank
        with CheckpointManager(directory, net, opt, dataloader=position) as ckpt:
            ckpt.save(1)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("bad, match", [
    (dict(every=0), "every must be a positive int"),
    (dict(keep=0), "keep must be a positive int or None"),
    (dict(scheduler=object()), "scheduler must have state_dict"),
])
def test_bad_arguments_are_refused(tmp_path, bad, match):
    net, opt, _, _ = _fresh()
    with pytest.raises((ValueError, TypeError), match=match):
        CheckpointManager(tmp_path, net, opt, **bad)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        CheckpointManager(tmp_path, object(), opt)
    ckpt = CheckpointManager(tmp_path, net, opt)
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        ckpt.save(-1)
    ckpt.close()
    with pytest.raises(CheckpointError, match="after close"):
        ckpt.save(1)


# -- a rank killed, the job restarted --------------------------------------------------------


def _torchrun(out, strategy, kill="", restarts=1, model="plain"):
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(RANKS.get(strategy, 2)), "--max-restarts",
               str(restarts), os.path.join(REPO, "tests", "checkpoint_job.py"), str(out),
               "--strategy", strategy, "--steps", "6", "--every", "2", "--model", model]
    if kill:
        command += ["--kill", kill]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=110)


RANKS = {"hsdp": 4}
# where a rank dies: (the step, counted from 1; the step the job resumes from, with a
# checkpoint every 2: the last one complete before it, the one in flight never is)
POINTS = {"forward": (5, 4), "backward": (3, 2), "optimizer": (3, 2), "checkpoint": (4, 2)}
_STRAIGHT: dict = {}


def _straight(strategy, tmp_path_factory, model="plain"):
    """The run never interrupted, once per strategy (and model)."""
    if (strategy, model) not in _STRAIGHT:
        out = tmp_path_factory.mktemp(f"straight-{strategy}-{model}")
        done = _torchrun(out / "run", strategy, model=model)
        assert done.returncode == 0, done.stderr[-3000:]
        _STRAIGHT[strategy, model] = out / "run"
    return _STRAIGHT[strategy, model]


def _killed_and_restarted(strategy, point, rank, tmp_path, tmp_path_factory, model="plain"):
    straight = _straight(strategy, tmp_path_factory, model)
    step, resumed = POINTS[point]
    killed = _torchrun(tmp_path / "killed", strategy, f"{step}:{point}:{rank}", model=model)
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "exitcode: -9" in killed.stderr  # torchrun names the SIGKILL
    world = RANKS.get(strategy, 2)
    attempts = (tmp_path / "killed" / "attempts.txt").read_text().split("\n")
    assert attempts[:2] == [f"0 0 {world}", f"1 {resumed} {world}"]
    for r in range(world):
        a = torch.load(straight / f"result-{r}.pt", weights_only=False)
        b = torch.load(tmp_path / "killed" / f"result-{r}.pt", weights_only=False)
        assert a["step"] == b["step"] == 6 and a["lr"] == b["lr"]
        assert a["evals"][-(6 - resumed) // 2:] == b["evals"][-(6 - resumed) // 2:]
        for key in a["model"]:
            assert torch.equal(a["model"][key], b["model"][key]), key
        assert a["optim"].keys() == b["optim"].keys()
        for name, slots in a["optim"].items():
            for slot, value in slots.items():
                assert torch.equal(value, b["optim"][name][slot]), (name, slot)


@pytest.mark.parametrize("strategy, point, rank", [
    ("fsdp", "backward", 1), ("ddp", "checkpoint", 0)], ids=["fsdp-backward", "ddp-checkpoint"])
def test_a_killed_rank_restarts_and_finishes_bit_for_bit(strategy, point, rank, tmp_path,
                                                         tmp_path_factory):
    _killed_and_restarted(strategy, point, rank, tmp_path, tmp_path_factory)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2"])
def test_the_loops_users_write_restart_bit_for_bit(strategy, tmp_path, tmp_path_factory):
    """Tied weights, BatchNorm's running statistics, a frozen layer, dropout, two
    accumulated halves (the first under no_sync) and an eval forward every second step:
    a rank killed in step 3's backward, the job restarted from step 2's checkpoint and
    finished bit for bit, evals included, as the run never interrupted."""
    _killed_and_restarted(strategy, "backward", 1, tmp_path, tmp_path_factory, "rich")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2", "hsdp", "tp", "pp"])
@pytest.mark.parametrize("point", list(POINTS))
def test_the_fault_matrix(strategy, point, tmp_path, tmp_path_factory):
    """A rank killed at each point of a step under each layout (the long profile)."""
    _killed_and_restarted(strategy, point, 1, tmp_path, tmp_path_factory)


# -- under spmd's own launcher --------------------------------------------------------------


def _agent(out, strategy, kill, *launcher):
    command = [sys.executable, "-m", "spmd.runtime.run", *launcher,
               os.path.join(REPO, "tests", "checkpoint_job.py"), str(out), "--strategy",
               strategy, "--steps", "6", "--every", "2"] + (["--kill", kill] if kill else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _results(out, world):
    return [torch.load(out / f"result-{r}.pt", weights_only=False) for r in range(world)]


def test_under_spmd_run_a_killed_rank_restarts_and_finishes_bit_for_bit(tmp_path,
                                                                       tmp_path_factory):
    straight = _straight("fsdp", tmp_path_factory)
    (tmp_path / "killed").mkdir()
    agent = _agent(tmp_path / "killed", "fsdp", "3:backward:1", "--standalone",
                   "--nproc-per-node", "2", "--max-restarts", "1")
    _, err = agent.communicate(timeout=110)
    assert agent.returncode == 0, err[-3000:]
    assert ("restarting the job (restart 1 of 1) after rank 1 (local rank 1 on this host) "
            "was killed by signal SIGKILL") in err
    attempts = (tmp_path / "killed" / "attempts.txt").read_text().split("\n")
    assert attempts[:2] == ["0 0 2", "1 2 2"]
    for a, b in zip(_results(straight, 2), _results(tmp_path / "killed", 2)):
        for key in a["model"]:
            assert torch.equal(a["model"][key], b["model"][key]), key


def test_a_lost_host_and_the_job_continues_on_the_rest(tmp_path, tmp_path_factory):
    """Two hosts (agents over 127.0.0.1) of one rank each, ``--nnodes 1:2``; at step 3
    host 1's agent is killed (its rank with it): host 0 restarts alone, resumes the
    2-rank checkpoint of step 2 on 1 rank (resharded) and finishes the same run (to
    1e-12: the gradient's sum taken in another order)."""
    from spmd.runtime.launch import free_port

    straight = _straight("fsdp", tmp_path_factory)
    out = tmp_path / "lost"
    out.mkdir()
    common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
              "--master-port", str(free_port()), "--max-restarts", "1",
              "--join-last-call", "1", "--join-timeout", "60"]
    agents = [_agent(out, "fsdp", "3:host:1", "--node-rank", str(node), *common)
              for node in (0, 1)]
    errs = [a.communicate(timeout=110)[1] for a in agents]
    assert agents[1].returncode == -9
    assert agents[0].returncode == 0, errs[0][-3000:]
    assert "restarting the job (restart 1 of 1) after rank" in errs[0]
    attempts = (out / "attempts.txt").read_text().split("\n")
    assert attempts[:2] == ["0 0 2", "1 2 1"]
    (alone,) = _results(out, 1)
    whole = _results(straight, 2)[0]
    assert alone["step"] == 6 and alone["lr"] == whole["lr"]
    for key, value in whole["model"].items():
        torch.testing.assert_close(alone["model"][key], value, rtol=0, atol=1e-12)


def test_the_store_hosts_death_is_named_in_seconds(tmp_path):
    """Host 0 serves the store; its agent killed (its rank with it) at step 3: host 1's
    agent says the store's host is gone within SPMD_STORE_RECONNECT (10 s), instead of
    reconnecting for the store's whole timeout (300 s), and, alone of two (host 0 might
    be cut off and running on), elects no new store though a restart is left."""
    from spmd.runtime.launch import free_port

    out = tmp_path / "store"
    out.mkdir()
    port = free_port()
    common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
              "--master-port", str(port), "--join-last-call", "1", "--max-restarts", "1"]
    agents = [_agent(out, "fsdp", "3:host:0", "--node-rank", str(node), *common)
              for node in (0, 1)]
    errs = [a.communicate(timeout=100)[1] for a in agents]
    assert agents[0].returncode == -9
    assert agents[1].returncode == 1
    assert (f"node 1: the store's host (node 0 at 127.0.0.1:{port}) is gone (TCPStore "
            f"127.0.0.1:{port}") in errs[1]
    assert "1 of the last round's 2 hosts are left, not more than half: no new store" in errs[1]


def test_the_store_hosts_death_elects_a_new_one_and_the_run_goes_on(tmp_path,
                                                                    tmp_path_factory):
    """Three hosts (``--nnodes 2:3 --max-restarts 1``; host 0 with 2 ranks, hosts 1 and 2
    with one each); host 0, serving the store, killed at step 3: host 1, the first of the
    others, serves a new store at its address, host 2 finds it there, and the job
    restarts on the two (more than half of three), resumes the 4-rank checkpoint of step
    2 on 2 ranks and finishes the same run (to 1e-12)."""
    from spmd.runtime.launch import free_port

    straight = _straight("fsdp", tmp_path_factory)
    out = tmp_path / "elected"
    out.mkdir()
    common = ["--nnodes", "2:3", "--master-addr", "127.0.0.1",
              "--master-port", str(free_port()), "--max-restarts", "1",
              "--join-last-call", "1"]
    agents = [_agent(out, "fsdp", "3:host:0", "--node-rank", str(node), "--nproc-per-node",
                     str(2 if node == 0 else 1), *common) for node in (0, 1, 2)]
    errs = [a.communicate(timeout=110)[1] for a in agents]
    assert agents[0].returncode == -9
    assert [a.returncode for a in agents[1:]] == [0, 0], errs
    for err in errs[1:]:
        assert "node 1 serves the store now at 127.0.0.1:" in err
        assert "restarting the job (restart 1 of 1)" in err
    attempts = (out / "attempts.txt").read_text().split("\n")
    assert attempts[:2] == ["0 0 4", "1 2 2"]
    for got, whole in zip(_results(out, 2), _results(straight, 2)):
        assert got["step"] == 6 and got["lr"] == whole["lr"]
        for key, value in whole["model"].items():
            torch.testing.assert_close(got["model"][key], value, rtol=0, atol=1e-12)


def test_a_host_that_joins_later_continues_the_same_run_on_more_ranks(tmp_path,
                                                                      tmp_path_factory):
    """``--nnodes 1:2``: host 0 trains alone; host 1 starts once the checkpoint of step 2
    exists; the launcher ends host 0's round and starts one with both, which resumes that
    checkpoint (written by 1 rank) on 2 ranks and finishes the same run (to 1e-12)."""
    from spmd.runtime.launch import free_port

    straight = _straight("fsdp", tmp_path_factory)
    out = tmp_path / "grow"
    out.mkdir()
    common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
              "--master-port", str(free_port()), "--join-last-call", "1"]
    # host 0's job waits at step 3 until host 1's agent has started (so the round is
    # ended mid-run, deterministically), at most 60 s
    first = _agent(out, "fsdp", "3:wait-for-host:0", "--node-rank", "0", *common)
    deadline = time.monotonic() + 90
    while not (out / "partition-me").exists():
        assert time.monotonic() < deadline and first.poll() is None, "host 0 never waited"
        time.sleep(0.05)  # polling a file the job writes, not ordering by time
    second = _agent(out, "fsdp", "", "--node-rank", "1", *common)
    errs = [a.communicate(timeout=110)[1] for a in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], errs
    attempts = (out / "attempts.txt").read_text().split("\n")
    assert attempts[:2] == ["0 0 1", "0 2 2"]
    whole = _results(straight, 2)
    for rank, got in enumerate(_results(out, 2)):
        assert got["step"] == 6 and got["lr"] == whole[rank]["lr"]
        for key, value in whole[rank]["model"].items():
            torch.testing.assert_close(got["model"][key], value, rtol=0, atol=1e-12)


def test_an_agent_lost_before_its_ranks_joined_is_named_not_waited_on(tmp_path):
    """Host 1's agent freezes (SIGSTOP) as its round starts, its rank never joining the
    rendezvous: host 0's rank would wait the rendezvous's whole timeout. Host 0's agent
    sees host 1's agent beat no more (``--agent-timeout 3``), names it, and restarts the
    job alone (``--nnodes 1:2``), which finishes."""
    from spmd.runtime.launch import free_port

    out = tmp_path / "frozen"
    out.mkdir()
    common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
              "--master-port", str(free_port()), "--max-restarts", "1",
              "--join-last-call", "1", "--agent-timeout", "3"]
    first = _agent(out, "fsdp", "", "--node-rank", "0", *common)
    env = dict(os.environ, PYTHONPATH=REPO)
    frozen = subprocess.Popen(  # its "rank" stops its agent, then never joins
        [sys.executable, "-m", "spmd.runtime.run", "--node-rank", "1", *common,
         "--no-python", "sh", "-c", "kill -STOP $PPID; sleep 120"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = first.communicate(timeout=100)
    finally:
        frozen.kill()  # (stopped: SIGKILL still ends it, and its rank with it)
        frozen.wait()
    assert first.returncode == 0, err[-3000:]
    assert "node 1's agent stopped answering (no beat for 3 s)" in err
    assert (out / "attempts.txt").read_text().split("\n")[:1] == ["1 0 1"]

