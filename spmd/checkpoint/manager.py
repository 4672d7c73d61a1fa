"""Checkpoints that never lose work and never stall training: :class:`CheckpointManager`.

Every ``every`` steps the manager takes a copy of what this rank holds (the model and
optimizer state as :func:`spmd.checkpoint.get_state_dict` lays it out, the LR scheduler,
the data loader's position, the random number generators and the step) and writes it on
a thread of its own, through ``torch.distributed.checkpoint`` on a process group of its
own, while the next steps run. A checkpoint is written into ``step-NNNNNNNN.partial``
and renamed to ``step-NNNNNNNN`` only once every rank's files are on disk and rank 0 has
written the manifest (``manifest.json``: each file's size and CRC-32); a directory
without one, or whose files disagree with it, is never read. The last ``keep`` complete
checkpoints are kept.

:meth:`CheckpointManager.restore` finds the latest complete checkpoint and loads it into
the model and optimizer under whatever layout and number of ranks the job has now (DCP
reshards), so a job restarted with fewer or more hosts continues the same run.

    ckpt = spmd.checkpoint.CheckpointManager("ckpt/", model, opt, scheduler=sched,
                                             dataloader=loader, every=100, keep=3)
    start = ckpt.restore() or 0           # the step the latest checkpoint was taken after
    for step in range(start, steps):
        train_step(next(batches))
        ckpt.save(step + 1)               # every 100 steps; returns at once
    ckpt.close()                          # waits for the last write

Every rank constructs the manager, and calls ``save`` and ``restore`` with the same
arguments in the same order (they are collective, like ``dcp.save``). The directory must
be one that every rank sees (a shared file system, as for DCP).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import re
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.nn as nn

from spmd.checkpoint.files import (MANIFEST, CheckpointError, _crc, _fsync_dir, _save_file,
                                   check_checkpoint)
from spmd.state.chunked import ChunkedTensor
from spmd.state.rng import rng_state, set_rng_state

__all__ = ["CheckpointManager", "CheckpointError", "SaveStats", "check_checkpoint"]

log = logging.getLogger("spmd.checkpoint")

_NAME = re.compile(r"^step-(\d{8,})$")
_PARTIAL = ".partial"
_STATE = "state.pt"  # the job's own state: step, scheduler, world size (rank 0 writes it)


@dataclass
class SaveStats:
    """What one checkpoint cost: seconds the training thread spent waiting for the last
    write (``waited``) and copying the state off the training path (``staged``), and the
    seconds the write took on its thread (``written``; 0 until it finishes)."""

    step: int
    waited: float = 0.0
    staged: float = 0.0
    written: float = 0.0
    bytes: int = 0


def _stage(value: Any) -> Any:
    """A copy of ``value`` that later training steps cannot change: tensors cloned (a
    :class:`ChunkedTensor` keeps its chunks), containers copied, the rest as is."""
    if isinstance(value, ChunkedTensor):
        return ChunkedTensor(value.to_local().detach().clone(), tuple(value.shape),
                             value._chunks)
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _stage(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_stage(v) for v in value)
    return value


def _nbytes(value: Any) -> int:
    if isinstance(value, ChunkedTensor):
        local = value.to_local()
        return local.numel() * local.element_size()
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


@contextlib.contextmanager
def _one_process_quiet(alone: bool) -> Any:
    """DCP warns that it assumes one process where torch.distributed is not initialized:
    here that is what was asked."""
    with warnings.catch_warnings():
        if alone:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _yielding() -> None:
    """The writer thread gives way to training for the CPU: a lower priority (nice 10;
    on Linux a thread's own), so the copy, pickling and checksums run in the time the
    training threads leave (waiting on communication, say), not in theirs."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10))
        except OSError:  # not permitted here: the write runs at the training's priority
            pass


class CheckpointManager:
    """Asynchronous, atomic checkpoints of a training job every ``every`` steps, the
    last ``keep`` kept (None: all); see the module doc.

    Args:
        directory: where checkpoints go (every rank must see the same directory).
        model: the model (parallelized under any layout, or plain).
        optimizer: its optimizer, or None.
        scheduler: an LR scheduler (anything with ``state_dict``/``load_state_dict``),
            the same on every rank.
        dataloader: the data loader or sampler whose position is saved (anything with
            ``state_dict``/``load_state_dict``, e.g. torchdata's ``StatefulDataLoader``),
            saved per rank.
        every: save every this many steps (``save(step)`` with ``step % every == 0``).
        keep: how many complete checkpoints to keep (the newest), None for all.
        async_save: write on the manager's thread (True) or before ``save`` returns.
        rng: save and restore each rank's random generators (Python, NumPy, torch).
        verify: check each file's CRC-32 before reading a checkpoint (sizes always).
        group: the ranks that save (default: the world); every rank of it must take part.
        timeout: how long the write's collectives wait for a peer (default: the group's).
    """

    def __init__(self, directory: str | os.PathLike, model: nn.Module,
                 optimizer: torch.optim.Optimizer | None = None, *, scheduler: Any = None,
                 dataloader: Any = None, every: int = 1, keep: int | None = 3,
                 async_save: bool = True, rng: bool = True, verify: bool = True,
                 group: Any = None, timeout: timedelta | float | None = None) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"CheckpointManager: every must be a positive int, got {every!r}")
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool)
                                 or keep < 1):
            raise ValueError(f"CheckpointManager: keep must be a positive int or None, "
                             f"got {keep!r}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"CheckpointManager: model must be an nn.Module, got "
                            f"{type(model).__name__}")
        for name, thing in (("scheduler", scheduler), ("dataloader", dataloader)):
            if thing is not None and not (hasattr(thing, "state_dict")
                                          and hasattr(thing, "load_state_dict")):
                raise TypeError(f"CheckpointManager: {name} must have state_dict() and "
                                f"load_state_dict(), got {type(thing).__name__}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.model, self.optimizer = model, optimizer
        self.scheduler, self.dataloader = scheduler, dataloader
        self.every, self.keep, self.async_save = every, keep, async_save
        self.rng, self.verify = rng, verify
        self.stats: list[SaveStats] = []
        self._pending: concurrent.futures.Future | None = None
        self._pending_step: int | None = None
        self._closed = False
        self._setup_group(group, timeout)
        if self.rank == 0:
            os.makedirs(self.directory, exist_ok=True)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="spmd-checkpoint", initializer=_yielding)

    # -- the group the writes run on -------------------------------------------------

    def _setup_group(self, group: Any, timeout: timedelta | float | None) -> None:
        from spmd import runtime as dist
        from spmd.runtime.torch_groups import torch_group

        self._group = self._torch_pg = None
        self.rank, self.world_size = 0, 1
        if not dist.is_initialized():
            return
        ranks = None if group is None else list(group.ranks)
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=timeout)
        # a group of its own: the writes' collectives run on the manager's thread while
        # training runs its own on the others
        self._group = dist.new_group(ranks, timeout=timeout)
        self.rank, self.world_size = self._group.rank(), self._group.size()
        if self.rank < 0:
            raise ValueError("CheckpointManager: this rank is not in the saving group")
        self._torch_pg = torch_group(self._group)
        if self._torch_pg is None:
            raise CheckpointError(
                "CheckpointManager needs torch.distributed to see spmd's process groups "
                "(torch.distributed.checkpoint runs on them); it cannot where ranks are "
                "threads of one process or the program initialized torch.distributed "
                "itself")

    def _everyone(self, value: Any) -> list[Any]:
        """``value`` of every rank of the group, in rank order."""
        if self._group is None:
            return [value]
        from spmd import runtime as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self._group)
        return out

    def _from_first(self, value: Any) -> Any:
        if self._group is None:
            return value
        from spmd import runtime as dist

        box = [value]
        dist.broadcast_object_list(box, src=self._group.ranks[0], group=self._group)
        return box[0]

    # -- saving ------------------------------------------------------------------------

    def path(self, step: int) -> str:
        """The directory of the checkpoint taken after ``step``."""
        return os.path.join(self.directory, f"step-{step:08d}")

    def save(self, step: int, *, force: bool = False) -> bool:
        """Checkpoint after ``step`` when it is a multiple of ``every`` (or ``force``):
        wait for the last write if it is still running, copy the state, and write it on
        the manager's thread (``async_save``) or now. True when a checkpoint was started.
        A failed earlier write raises :class:`CheckpointError` here."""
        if self._closed:
            raise CheckpointError("CheckpointManager.save after close()")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"CheckpointManager.save: step must be a non-negative int, "
                             f"got {step!r}")
        if not force and step % self.every:
            return False
        stats = SaveStats(step)
        start = time.perf_counter()
        self.wait()
        stats.waited = time.perf_counter() - start
        start = time.perf_counter()
        staged = self._staged(step)
        stats.staged = time.perf_counter() - start
        stats.bytes = _nbytes(staged)
        self.stats.append(stats)
        if self.async_save:
            self._pending = self._executor.submit(self._write, step, staged, stats)
            self._pending_step = step
        else:
            self._write(step, staged, stats)
        return True

    def wait(self) -> None:
        """Block until the write in flight (if any) is complete; raise its error."""
        pending, step = self._pending, self._pending_step
        self._pending = self._pending_step = None
        if pending is None:
            return
        try:
            pending.result()
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"checkpoint {self.path(step)}: the write failed: "
                                  f"{type(e).__name__}: {e}") from e

    def close(self) -> None:
        """Wait for the last write and stop the manager's thread (its group stays)."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _staged(self, step: int) -> dict[str, Any]:
        from spmd.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        mine: dict[str, Any] = {}
        buffers = _own_buffers(self.model, model_sd)
        if buffers:  # each rank's (BatchNorm's statistics differ across ranks)
            mine["buffers"] = buffers
        if self.rng:
            mine["rng"] = rng_state()
        if self.dataloader is not None:
            mine["dataloader"] = self.dataloader.state_dict()
        job = {"step": step, "world_size": self.world_size,
               "scheduler": None if self.scheduler is None else self.scheduler.state_dict()}
        return _stage({"dcp": {"model": model_sd, "optim": optim_sd}, "rank": mine,
                       "job": job})

    def _write(self, step: int, staged: dict[str, Any], stats: SaveStats) -> None:
        """Write one checkpoint (on the manager's thread): rank 0 makes the partial
        directory, every rank writes its part, rank 0 commits; a failure on any rank is
        every rank's error, never a peer left waiting."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        start = time.perf_counter()
        final, partial = self.path(step), self.path(step) + _PARTIAL
        ready = "ok"
        if self.rank == 0:  # a partial directory of this step left by a crash goes first
            try:
                shutil.rmtree(partial, ignore_errors=True)
                if os.path.exists(final):
                    shutil.rmtree(final)
                os.makedirs(partial)
            except OSError as e:
                ready = f"rank 0 could not make {partial}: {e}"
        ready = self._from_first(ready)
        if ready != "ok":
            raise CheckpointError(f"checkpoint {final}: {ready}")
        writer = dcp.FileSystemWriter(partial, sync_files=True)
        with _one_process_quiet(self._group is None):
            # what every rank has a copy of is written once: rank 0's (the buffers DDP
            # broadcasts), not whichever rank DCP's balancing picks
            dcp.save(staged["dcp"], storage_writer=writer, process_group=self._torch_pg,
                     planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True),
                     no_dist=self._group is None)  # collective: raises on every rank alike
        mine: dict[str, Any] | str
        try:
            name = f"rank-{self.rank:05d}.pt"
            _save_file(staged["rank"], os.path.join(partial, name))
            written = [name, f"__{self.rank}_0.distcp"]
            if self.rank == 0:
                _save_file(staged["job"], os.path.join(partial, _STATE))
                written += [_STATE, ".metadata"]
            mine = {n: _crc(os.path.join(partial, n)) for n in written
                    if os.path.isfile(os.path.join(partial, n))}
        except OSError as e:
            mine = f"rank {self.rank}: {e}"
        everyone = self._everyone(mine)
        outcome = "ok"
        if self.rank == 0:
            try:
                failed = [part for part in everyone if isinstance(part, str)]
                if failed:
                    raise CheckpointError("; ".join(failed))
                self._commit(step, partial, final, everyone)
            except Exception as e:  # every rank learns the commit failed
                outcome = f"{type(e).__name__}: {e}"
        outcome = self._from_first(outcome)
        stats.written = time.perf_counter() - start
        if outcome != "ok":
            raise CheckpointError(f"checkpoint {final}: not committed: {outcome}")

    def _commit(self, step: int, partial: str, final: str, parts: list[dict]) -> None:
        """Rank 0: the manifest written and synced, then the directory renamed (atomic:
        complete, or not there under its final name at all), then old ones retired."""
        files: dict[str, Any] = {}
        for part in parts:
            files.update(part)
        manifest = {"step": step, "world_size": self.world_size, "files": files,
                    "saved": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        with open(os.path.join(partial, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(partial)
        os.rename(partial, final)
        _fsync_dir(self.directory)
        self._retire(step)

    def _retire(self, newest: int) -> None:
        """Remove complete checkpoints beyond ``keep`` and partial ones of older steps."""
        steps = sorted(self.all_steps(), reverse=True)
        if self.keep is not None:
            for step in steps[self.keep:]:
                shutil.rmtree(self.path(step), ignore_errors=True)
        for name in os.listdir(self.directory):
            if name.endswith(_PARTIAL):
                match = _NAME.match(name[:-len(_PARTIAL)])
                if match and int(match.group(1)) < newest:
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    # -- reading -----------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """The steps of the directories named as complete checkpoints, oldest first (not
        verified: :meth:`latest_step` checks them)."""
        if not os.path.isdir(self.directory):
            return []
        found = []
        for name in os.listdir(self.directory):
            match = _NAME.match(name)
            if match and os.path.isdir(os.path.join(self.directory, name)):
                found.append(int(match.group(1)))
        return sorted(found)

    def _choose(self, step: int | None) -> tuple[int | None, list[str]]:
        """(the step to restore, the checkpoints refused on the way and why), decided
        on rank 0."""
        refused: list[str] = []
        if step is not None:
            try:
                check_checkpoint(self.path(step), self.verify)
            except CheckpointError as e:
                return None, [str(e)]
            return step, []
        for candidate in sorted(self.all_steps(), reverse=True):
            try:
                check_checkpoint(self.path(candidate), self.verify)
            except CheckpointError as e:
                refused.append(str(e))
                continue
            return candidate, refused
        return None, refused

    def latest_step(self) -> int | None:
        """The step of the latest complete checkpoint (every rank agrees), or None."""
        self.wait()
        chosen, refused = self._from_first(self._choose(None) if self.rank == 0 else None)
        for why in refused:
            log.warning("spmd.checkpoint: skipped %s", why)
        return chosen

    def restore(self, step: int | None = None) -> int | None:
        """Load the latest complete checkpoint (or the one after ``step``) into the
        model, optimizer, scheduler, data loader and random generators; its step, or
        None when there is none (a fresh start). Checkpoints refused on the way (partial,
        corrupt) are named in a warning; asking for one by ``step`` raises
        :class:`CheckpointError` naming what is wrong."""
        import torch.distributed.checkpoint as dcp

        from spmd.checkpoint.state_dict import _plain, get_state_dict, set_state_dict

        self.wait()
        chosen, refused = self._from_first(self._choose(step) if self.rank == 0 else None)
        if step is not None and chosen is None:
            raise CheckpointError(refused[0] if refused else
                                  f"checkpoint {self.path(step)}: not found")
        for why in refused:
            log.warning("spmd.checkpoint: skipped %s", why)
        if chosen is None:
            return None
        path = self.path(chosen)
        fresh = self.optimizer is not None and not self.optimizer.state
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        stateless: list[str] = []
        if self.optimizer is None:
            state.pop("optim")
        elif fresh:  # get_state_dict made every parameter's state to load into; those
            # the checkpoint has none of (no gradient reached them yet) get none
            saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
            keys = [k for k in saved if k.startswith("optim.state.")]
            stateless = [n for n in optim_sd["state"]
                         if not any(k.startswith(f"optim.state.{n}.") for k in keys)]
            for name in stateless:
                del optim_sd["state"][name]
        with _one_process_quiet(self._group is None):
            dcp.load(state, storage_reader=dcp.FileSystemReader(path),
                     process_group=self._torch_pg, no_dist=self._group is None)
        job = torch.load(os.path.join(path, _STATE), weights_only=False)
        own = None  # this rank's file, where the world size is the saving job's
        if job["world_size"] == self.world_size:
            own = torch.load(os.path.join(path, f"rank-{self.rank:05d}.pt"),
                             weights_only=False)
            # its own buffers, not rank 0's: the same ranks resume bit for bit
            state["model"].update(own.get("buffers", {}))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state.get("optim"))
        if stateless:
            params = dict(_plain(self.model).named_parameters())
            for name in stateless:
                self.optimizer.state.pop(params[name], None)
        if self.scheduler is not None:
            if job["scheduler"] is None:
                raise CheckpointError(f"checkpoint {path}: has no scheduler state")
            self.scheduler.load_state_dict(job["scheduler"])
        self._restore_rank_state(path, job["world_size"], own)
        return chosen

    def _restore_rank_state(self, path: str, saved_world: int, own: Any) -> None:
        """This rank's own saved generators and data position (``own``) where the world
        size is the saving job's; where it changed, those the saving ranks shared
        (generators that differed are left as they are, with a warning; data positions
        that differed are an error: the batches would not be the run's)."""
        if not (self.rng or self.dataloader is not None):
            return
        if saved_world == self.world_size:
            mine = own
            differ: list[str] = []
            shared = True
        else:  # what every saving rank had alike
            saved = [torch.load(os.path.join(path, f"rank-{r:05d}.pt"), weights_only=False)
                     for r in range(saved_world)]
            mine = saved[0]
            rng = mine.get("rng", {})
            differ = [k for k in rng if any(_differ(s["rng"].get(k), rng[k]) for s in saved)]
            mine["rng"] = {k: v for k, v in rng.items() if k not in differ}
            shared = not any(_differ(s.get("dataloader"), mine.get("dataloader"))
                             for s in saved[1:])
        if self.rng and "rng" in mine:
            set_rng_state(mine["rng"])
            if differ:
                log.warning("spmd.checkpoint: %s was saved by %d ranks whose %s random "
                            "generators differed, and this job has %d: those are left as "
                            "they are", path, saved_world, ", ".join(differ),
                            self.world_size)
        if self.dataloader is None:
            return
        if "dataloader" not in mine:
            raise CheckpointError(f"checkpoint {path}: has no data loader state")
        if not shared:
            raise CheckpointError(
                f"checkpoint {path}: was saved by {saved_world} ranks whose data "
                f"loaders were at different positions, and this job has "
                f"{self.world_size}: a position per rank does not carry over to another "
                f"number of ranks; give a data loader whose state is the job's (a "
                f"global sample index, say)")
        self.dataloader.load_state_dict(mine["dataloader"])


def _own_buffers(model: nn.Module, model_sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model's buffers every rank holds whole (BatchNorm's running statistics, which
    each rank updates from its own batch unless synchronized), by checkpoint key."""
    from spmd.checkpoint.state_dict import _plain

    names = {name for name, _ in _plain(model).named_buffers()}
    return {k: v for k, v in model_sd.items()
            if k in names and isinstance(v, torch.Tensor) and not isinstance(v, ChunkedTensor)}


def _differ(a: Any, b: Any) -> bool:
    import numpy as np

    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
                    and np.array_equal(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                    and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() != b.keys() or any(_differ(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) != len(b) or any(_differ(x, y) for x, y in zip(a, b))
    return a != b
