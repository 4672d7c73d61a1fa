"""Uneven inputs: ranks that run out of batches shadow the others' collectives until every
rank is done, as ``torch.distributed.algorithms.Join`` does for DDP.

    with model.join():                 # or spmd.Join([model, ...])
        for x, y in my_batches:        # some ranks have fewer
            loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()

Every training forward of the context's first model all-reduces ``[1, sync,
accumulated]``; a rank that has left its loop all-reduces zeros instead, so each
iteration it learns how many ranks are still training and whether their step averages
gradients. Between two of those, a training rank's process group records the collectives
the step runs (the buffers' broadcast, each gradient bucket's all-reduce, in order, from
every model and from the eager safety net alike). A joined rank replays its own last
step's record with zeros while any rank trains: the others then average each gradient
over the initial number of ranks, the joined ones adding zeros (torch's
``divide_by_initial_world_size=True``). When all have joined, the last rank to join
broadcasts its parameters and buffers, so every rank ends with the same model, as torch's
DDP join does.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn as nn

from spmd.program.module import ModuleState
from spmd.program.program import program_of

__all__ = ["Join"]


class Join:
    """A context for uneven inputs over parallelized (``ddp``) models.

    Args:
        joinables: the parallelized models trained in the loop (the first one's forward
            tells the joined ranks about each step).
        enable: False makes the context do nothing (every rank has the same number of
            batches).
        throw_on_early_termination: raise on every rank as soon as one runs out of
            inputs, instead of shadowing.
        divide_by_initial_world_size: True (torch's default) averages each gradient over
            every rank of the group, joined ones contributing zeros; False is not
            supported.
    """

    def __init__(self, joinables: Iterable[nn.Module], enable: bool = True,
                 throw_on_early_termination: bool = False,
                 divide_by_initial_world_size: bool = True) -> None:
        self.models = list(joinables)
        if not self.models:
            raise ValueError("spmd.Join: pass at least one parallelized model")
        for m in self.models:
            state = program_of(m)
            if not isinstance(state, ModuleState):
                raise TypeError(f"spmd.Join: {type(m).__name__} is not a model spmd.parallelize "
                                f"returned")
            if state.sharded:
                raise ValueError(
                    f"spmd.Join: strategy {state.options.strategy!r} keeps one shard of every "
                    f"parameter on each rank, so a rank that stops would stop updating its "
                    f"shard; give every rank the same number of batches "
                    f"(DistributedSampler(drop_last=True))")
        if not divide_by_initial_world_size:
            raise ValueError("spmd.Join: divide_by_initial_world_size=False is not supported; "
                             "gradients are averaged over every rank of the group")
        self.enable = bool(enable)
        self.throw = bool(throw_on_early_termination)
        self.states = [m._spmd for m in self.models]  # type: ignore[attr-defined]
        self.group = self.states[0].group
        self.log: list[dict] | None = None  # this rank's current step's collectives
        self.log_synced = False

    # -- the context ------------------------------------------------------------------

    def __enter__(self) -> "Join":
        if self.enable and self.states[0].communicates:
            for state in self.states:
                state.join = self
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> bool:
        if self.group is not None:
            self.group.join_log = None  # the record of the last step ends here
        try:
            if kind is None and self.enable and self.states[0].communicates:
                self._shadow()
        finally:
            for state in self.states:
                state.join = None
        return False

    # -- training ranks ---------------------------------------------------------------

    def notify(self, state: Any) -> None:
        """Called by a model's training forward: tell joined ranks a step is coming."""
        if state is not self.states[0]:
            return
        from spmd.runtime.collectives import all_reduce

        flags = torch.tensor([1.0, float(state.sync.enabled), float(state.net.accumulated
                                                                     and state.sync.enabled)])
        self.group.join_log = None
        all_reduce(flags, group=self.group)
        if self.throw and flags[0] < self.group.size():
            raise RuntimeError(f"spmd.Join: {self.group.size() - int(flags[0])} rank(s) ran out "
                               f"of inputs (throw_on_early_termination=True)")
        self.log = self.group.join_log = []  # record this step's collectives
        self.log_synced = bool(state.sync.enabled)

    # -- joined ranks -----------------------------------------------------------------

    def _shadow(self) -> None:
        from spmd.runtime.collectives import ReduceOp, all_reduce

        first = True
        last_joiner = False
        while True:
            flags = torch.zeros(3)
            all_reduce(flags, group=self.group)
            if flags[0] == 0:
                last_joiner = first  # nobody was training when this rank joined
                break
            first = False
            if self.throw:
                raise RuntimeError(f"spmd.Join: this rank ran out of inputs while "
                                   f"{int(flags[0])} rank(s) still train "
                                   f"(throw_on_early_termination=True)")
            if flags[2] > 0 or (flags[1] > 0) != self.log_synced or 0 < flags[1] < flags[0]:
                raise RuntimeError("spmd.Join: the training ranks' step does not run the "
                                   "collectives of this rank's last step (no_sync() around "
                                   "some steps), so it cannot be shadowed; call join around "
                                   "loops whose steps all synchronise")
            self._replay()
        # every rank ends with the last joiner's model (it trained on every step)
        me = self.group.rank()
        source = torch.tensor([float(me if last_joiner else -1)])
        all_reduce(source, op=ReduceOp.MAX, group=self.group)
        src = self.group.ranks[int(source.item())]
        from spmd.eager.reducer import broadcast_coalesced

        for model in self.models:
            broadcast_coalesced([*model.parameters(), *model.buffers()], src, self.group)

    def _replay(self) -> None:
        """This rank's last step's collectives, in order, with zeros."""
        from spmd.runtime.collectives import all_reduce, broadcast

        if self.log is None:
            raise RuntimeError("spmd.Join: this rank ran out of inputs before its first "
                               "training step, so it does not know the step's collectives; "
                               "give every rank at least one batch")
        for entry in self.log:
            if entry["op"] == "all_reduce":
                shape, sparse_dim = entry["shape"], entry.get("sparse_dim")
                zeros = (torch.zeros(shape, dtype=entry["dtype"]) if sparse_dim is None else
                         torch.sparse_coo_tensor(  # no entries: adds nothing to the others'
                             torch.zeros((sparse_dim, 0), dtype=torch.long),
                             torch.zeros((0, *shape[sparse_dim:]), dtype=entry["dtype"]),
                             shape))
                all_reduce(zeros, op=entry["reduce"], group=self.group)
            elif entry["op"] == "broadcast":
                broadcast(torch.zeros(entry["shape"], dtype=entry["dtype"]), src=entry["src"],
                          group=self.group)
            else:
                raise RuntimeError(f"spmd.Join: the step runs {entry['op']} on the model's "
                                   f"group, which a joined rank does not shadow (all_reduce "
                                   f"and broadcast only)")
