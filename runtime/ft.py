"""Live recovery of data-parallel replicas, without a restart (as torchft does).

A replica is one process holding the whole model and optimizer, or a job of its own
(``world_size`` ranks sharding the model inside it: ``spmd.parallelize(strategy="fsdp")``
over the replica's default group, which makes the replicas an hsdp whose replicate
dimension may lose and gain members). Every rank joins a store every replica reaches
(served by a host that outlives the replicas: a launcher's agent, a small server).
Every step starts with a *quorum*: the replicas that are alive (every rank beating) and
asked to take part (every rank joined), agreed through the store (one atomic
compare-and-set decides it, so every rank reads the same members). When the members
change, rank k of each member joins a new process group with the members' ranks k
(``Manager.group``, apart from the replica's own default group); a member that joined
without state (a replacement) receives the model and optimizer state from the first
member that has it, rank k from rank k, over that group, before the step runs: no
checkpoint is read.

The gradients are averaged over the quorum. When a member dies during the average, the
others take a new quorum among the replicas still alive and average again, from a copy
of their own gradients made before the first attempt: the step's average is over the
replicas that finished it. Every step's members are recorded (``Manager.history``), so
the run equals, step by step, one process fed exactly the batches of the replicas that
took part.

    from spmd.runtime.ft import Manager

    ft = Manager(store, replica_id, initial_replicas=3, state_dict=...,
                 load_state_dict=...)
    while ft.step < steps:
        ft.start_step()                      # the quorum; a newcomer is healed here
        loss_of(batch(ft.step, ft.members)).backward()
        ft.average_gradients(model.parameters())
        opt.step(); opt.zero_grad()
        ft.end_step()

Liveness: each rank's thread beats ``ft/beat/<id>/<rank>`` every ``heartbeat`` seconds;
a member one of whose ranks has a beat older than ``dead_after`` seconds is left out of
the next quorum. A rank whose own replica lost a rank raises ``DistError`` naming it (the
replica's launcher restarts it, and it joins again as a replacement).
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Iterable

import torch

from spmd.runtime.collectives import all_reduce
from spmd.runtime.errors import DistError
from spmd.runtime.groups import get_rank, get_world_size, is_initialized, standalone_group
from spmd.runtime.objects import broadcast_object_list
from spmd.runtime.process_group import ProcessGroup
from spmd.runtime.store.base import Store
from spmd.runtime.store.prefix_store import PrefixStore

__all__ = ["Manager", "QuorumError"]


class QuorumError(DistError):
    """No quorum could be formed (too few replicas alive within the timeout)."""


class Manager:
    """One rank's side of the live-recovery protocol (see the module doc).

    Args:
        store: the store every replica reaches (one that outlives replicas).
        replica_id: this replica's name, unique among the live ones (a replacement may
            reuse a dead replica's); every rank of a replica passes the same.
        state_dict: returns what a newcomer needs (model and optimizer state; under
            sharding, this rank's shards).
        load_state_dict: puts a received state back.
        min_replicas: a quorum needs at least this many.
        initial_replicas: the job's first quorum waits for this many (default
            ``min_replicas``), at most ``timeout``.
        timeout: how long a quorum may take to form, and the groups' timeout.
        heartbeat: seconds between this rank's beats.
        dead_after: a member silent this long is left out of the next quorum.
        rank, world_size: this rank within its replica and the replica's size (default:
            the default process group's, when one is initialized, else 0 and 1). Every
            replica has the same size: rank k heals rank k.
    """

    def __init__(self, store: Store, replica_id: str, *,
                 state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None],
                 min_replicas: int = 1, initial_replicas: int | None = None,
                 timeout: timedelta = timedelta(seconds=60),
                 heartbeat: float = 0.2, dead_after: float = 2.0,
                 rank: int | None = None, world_size: int | None = None) -> None:
        if "/" in replica_id or not replica_id:
            raise ValueError(f"ft.Manager: replica_id must be a non-empty name without "
                             f"'/', got {replica_id!r}")
        if min_replicas < 1:
            raise ValueError(f"ft.Manager: min_replicas must be positive, got {min_replicas}")
        if world_size is None:
            world_size = get_world_size() if is_initialized() else 1
        if rank is None:
            rank = get_rank() if is_initialized() else 0
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"ft.Manager: rank {rank} is not in [0, world_size "
                             f"{world_size})")
        if heartbeat <= 0 or dead_after <= heartbeat:
            raise ValueError(f"ft.Manager: need 0 < heartbeat < dead_after, got "
                             f"heartbeat={heartbeat}, dead_after={dead_after}")
        self.store = PrefixStore("ft", store)
        self.replica_id, self.rank, self.world_size = replica_id, rank, world_size
        size = int(self.store.compare_set("replica_size", "", str(world_size)))
        if size != world_size:
            raise ValueError(f"ft.Manager: replica {replica_id} has {world_size} rank(s), "
                             f"the job's replicas {size}: every replica must have the same "
                             f"size (rank k heals rank k)")
        self._state_dict, self._load_state_dict = state_dict, load_state_dict
        self.min_replicas, self.timeout = min_replicas, timeout
        self.initial_replicas = max(min_replicas, initial_replicas or min_replicas)
        self.dead_after = dead_after
        self.step = 0  # the steps this replica's state has taken (healed with the state)
        self.members: list[str] = []
        self.history: list[list[str]] = []  # each finished step's members
        self.group: ProcessGroup | None = None  # rank k of each member, for this step
        # a rank after its replica's first looks for the first quorum its replica is in
        # from the one after the latest decided before it first beats; the first rank
        # joins only once every rank of its replica beats, so not before that one
        self._quorum = -1
        self._first = self._next_quorum()
        # known before the first beat: whoever sees this replica beating also finds it
        # among the newcomers a quorum waits for (registered only when its first rank
        # proposed, a survivor's quorum could close in between and leave it peerless)
        self._known()
        self._has_state = False
        self._group_members: list[str] | None = None
        self._stop = threading.Event()
        self._beat(heartbeat)

    # -- liveness ----------------------------------------------------------------------

    def _beat(self, interval: float) -> None:
        key = f"beat/{self.replica_id}/{self.rank}"
        self.store.set(key, str(time.time()))

        def beat() -> None:
            while not self._stop.wait(interval):
                try:
                    self.store.set(key, str(time.time()))
                except DistError:
                    return

        threading.Thread(target=beat, name=f"ft-beat-{self.replica_id}-{self.rank}",
                         daemon=True).start()

    def _silent(self, rid: str) -> list[int]:
        """The ranks of replica ``rid`` (this rank aside) without a recent beat."""
        now, silent = time.time(), []
        for k in range(self.world_size):
            if rid == self.replica_id and k == self.rank:
                continue
            try:
                last = float(self.store.get(f"beat/{rid}/{k}"))
            except DistError:
                last = 0.0
            if now - last >= self.dead_after:
                silent.append(k)
        return silent

    def _alive(self, rid: str) -> bool:
        return not self._silent(rid)

    def _check_own(self, since: float) -> None:
        """Raise once a rank of this replica stopped beating (given ``dead_after`` from
        ``since`` to start): the replica is lost, and its launcher starts it again."""
        silent = self._silent(self.replica_id)
        if silent and time.monotonic() - since > self.dead_after:
            raise DistError(f"ft: replica {self.replica_id}: rank(s) {silent} of this "
                            f"replica stopped beating (no beat for {self.dead_after} s): the "
                            f"replica is lost; restart it to join again as a replacement")

    # -- quorum ------------------------------------------------------------------------

    def _joined(self, q: int, rid: str) -> bool:
        """Every rank of ``rid`` joined quorum ``q``."""
        return all(self.store.check([f"q/{q}/join/{rid}/{k}"]) for k in range(self.world_size))

    def _form(self, need: list[str] | None, only: list[str] | None = None) -> dict | None:
        """Join the next quorum and return it (``ids``, ``fresh``: the members without
        state, ``q``): it closes once every member of ``need`` still alive has joined
        (with at least ``min_replicas``), or, after the timeout, with the ones there;
        ``only``: a redo of a step admits no one else (None: it went on without this
        replica). A replica counts as joined once every rank of it has; one
        compare-and-set decides it, so every rank reads the same. A member whose state is
        at an earlier step than the others' is ``fresh`` too. The replicas' first ranks
        decide; the others join and read."""
        q = self._quorum + 1 if self._quorum >= 0 else self._first
        start = time.monotonic()
        # a replica's ranks may start apart (up to the timeout); once they took part in
        # a quorum, one silent for dead_after is lost
        grace = start if self._quorum >= 0 else start + self.timeout.total_seconds() - \
            self.dead_after
        while self.rank == 0 and self._silent(self.replica_id):  # the whole replica joins
            self._check_own(grace)
            self._pause(q)
        while True:
            if only is not None and self.rank == 0:  # said before joining: seen by all
                self.store.compare_set(f"q/{q}/only", "", json.dumps(sorted(only)))
            # the step this replica's state is at (-1: none): a member behind the others
            # (left out of a quorum while alive, say) is healed like a newcomer
            self.store.set(f"q/{q}/join/{self.replica_id}/{self.rank}",
                           str(self.step) if self._has_state else "-1")
            decided = self.store.compare_set(f"q/{q}/members", "", "")
            if decided:
                members = json.loads(decided)
                if self.replica_id in members["ids"]:
                    self._quorum = q
                    if self.rank == 0:
                        self.store.set(f"member/{self.replica_id}", "1")
                    return members
                if only is not None:
                    return None  # a redo of our step went on without us
                q += 1  # closed without us: the next one
                continue
            if self.rank == 0:
                self._propose(q, need, only, start)
            else:
                self._check_own(grace)  # (this replica's first rank decides for it)
            late = time.monotonic() - start > 2 * self.timeout.total_seconds()
            if late:
                raise QuorumError(f"ft: replica {self.replica_id} (rank {self.rank}): no "
                                  f"quorum of {self.min_replicas} within {self.timeout}")
            self._pause(q)

    def _propose(self, q: int, need: list[str] | None, only: list[str] | None,
                 start: float) -> None:
        """Propose quorum ``q`` once it may close (a first rank's part of ``_form``)."""
        known = self._known()  # (this replica among them)
        joined = [r for r in known if self._joined(q, r)]
        restricted = self.store.compare_set(f"q/{q}/only", "", "")  # (read after)
        if restricted:  # a redo of a step: its members only
            allowed = json.loads(restricted)
            if self.replica_id not in allowed:
                return  # (the next loop finds it closed without us, or waits)
            joined = [r for r in joined if r in allowed]
        # a quorum waits for the members of the last one still alive (whoever proposes:
        # a newcomer too, or it could close without a live member, which would then go on
        # alone), and, unless it redoes a step, for newcomers alive that no quorum took yet
        wanted = list(need or [])
        last = self.store.compare_set(f"q/{q - 1}/members", "", "") if q > 0 else b""
        if last:
            wanted += [r for r in json.loads(last)["ids"] if r not in wanted]
        if only is None and not restricted:
            wanted += [r for r in known if r not in wanted
                       and not self.store.check([f"member/{r}"])]
        waiting = [r for r in wanted if r not in joined and self._alive(r)]
        late = time.monotonic() - start > self.timeout.total_seconds()
        first = q == 0 and len(joined) < self.initial_replicas  # the job's start
        at = {r: int(self.store.get(f"q/{q}/join/{r}/0")) for r in joined}
        top = max(at.values(), default=-1)
        fresh = [r for r in joined if at[r] < 0 or at[r] < top]
        healable = q == 0 or len(fresh) < len(joined)  # newcomers only with a peer
        if (len(joined) >= self.min_replicas and healable
                and ((not waiting and not first) or late)):
            proposal = json.dumps({"ids": joined, "fresh": fresh, "q": q})
            if self.store.compare_set(f"q/{q}/members", "", proposal) == proposal.encode():
                self.store.set("latest", str(q))

    def _pause(self, q: int) -> None:
        try:  # a short wait on a key nobody sets: the store's clock, not a sleep
            self.store.wait([f"q/{q}/none"], timedelta(seconds=0.05))
        except DistError:
            pass

    def _next_quorum(self) -> int:
        """A newcomer's first quorum: the one after the latest decided."""
        if not self.store.check(["latest"]):
            return 0
        return int(self.store.get("latest")) + 1

    def _known(self) -> list[str]:
        """Every replica ever seen (this one added), sorted: one key, compare-and-set."""
        raw = self.store.compare_set("known", "", "")
        known = json.loads(raw) if raw else []
        while self.replica_id not in known:
            new = json.dumps(sorted(set(known) | {self.replica_id}))
            got = self.store.compare_set("known", raw.decode() if raw else "", new)
            raw, known = got, json.loads(got) if got else []
        return known

    def _regroup(self, members: dict) -> None:
        """Rank k's group among the members' ranks k, built anew where they changed."""
        ids = members["ids"]
        if ids == self._group_members and not members["fresh"]:
            return
        self._drop_group()
        self.group = standalone_group(
            PrefixStore(f"g/{members['q']}/{self.rank}", self.store),
            ids.index(self.replica_id), len(ids), timeout=self.timeout,
            name=f"ft-{members['q']}-{self.rank}")
        self._group_members = ids

    def _drop_group(self) -> None:
        if self.group is not None:
            self.group._destroy()
            self.group = None

    def _decide(self) -> str:
        """``"commit"`` once every rank of every member voted ok, ``"redo"`` once one
        failed or a member died without voting; decided once (compare-and-set), read
        alike by every rank."""
        q = self._quorum
        key = f"q/{q}/decision"
        while True:
            decided = self.store.compare_set(key, "", "")
            if decided:
                return decided.decode()
            votes = {(r, k): self.store.get(f"q/{q}/vote/{r}/{k}").decode()
                     if self.store.check([f"q/{q}/vote/{r}/{k}"]) else None
                     for r in self.members for k in range(self.world_size)}
            if all(v == "ok" for v in votes.values()):
                self.store.compare_set(key, "", "commit")
            elif any(v == "fail" for v in votes.values()) or any(
                    v is None and not self._alive(r) for (r, _), v in votes.items()):
                self.store.compare_set(key, "", "redo")
            else:
                try:
                    self.store.wait([key], timedelta(seconds=0.05))
                except DistError:
                    pass

    # -- the step ----------------------------------------------------------------------

    def start_step(self) -> list[str]:
        """The quorum for this step (its members' ids). A member that joined without
        state (a replacement) receives the first stateful member's ``state_dict()`` and
        step count over the new group (rank k from rank k); at the job's first step every
        member is fresh and starts from its own (equal, seeded) state."""
        members = self._form(self.members or None)
        assert members is not None  # (only a redo can be left)
        self._regroup(members)
        self.members = members["ids"]
        if members["fresh"] and len(members["fresh"]) < len(self.members):
            src = next(i for i, r in enumerate(self.members) if r not in members["fresh"])
            box = [(self.step, self._state_dict()) if self.members[src] == self.replica_id
                   else None]
            broadcast_object_list(box, src=src, group=self.group)  # (every member's part)
            if self.replica_id in members["fresh"]:
                self.step, state = box[0]
                self._load_state_dict(state)
        self._has_state = True
        return self.members

    def average_gradients(self, params: Iterable[torch.Tensor]) -> list[str]:
        """Average the gradients over the quorum and return the members it was over
        (empty, the gradients zeroed, where the others went on without this replica:
        its state is replaced at the next quorum).
        Every rank votes on the all-reduce it saw (through the store); the average is
        kept only when every member's ranks' succeeded. When one failed or a member died,
        the replicas still alive take a new quorum among themselves and average again,
        from copies of their own gradients made before the first attempt. Under sharding
        inside a replica, ``params`` are this rank's shards (their gradients already
        reduced inside the replica), averaged with the same shards of the others."""
        grads = [p.grad for p in params if p.grad is not None]
        mine = torch.cat([g.detach().reshape(-1) for g in grads]) if grads else torch.zeros(0)
        while True:
            flat = mine.clone()
            try:
                all_reduce(flat, group=self.group)
                vote = "ok"
            except DistError:
                vote = "fail"
            self.store.set(f"q/{self._quorum}/vote/{self.replica_id}/{self.rank}", vote)
            if self._decide() == "commit":
                flat /= len(self.members)
                offset = 0
                for g in grads:
                    g.copy_(flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()
                return list(self.members)
            lost = list(self.members)
            members = self._form(need=lost, only=lost)
            if members is None:  # taken for dead (a stall): drop the step and our state;
                self._has_state = False  # the next quorum waits for us and heals us
                if self.rank == 0:
                    self.store.delete_key(f"member/{self.replica_id}")
                self.members = []
                for g in grads:
                    g.zero_()
                return []
            self._regroup(members)
            self.members = members["ids"]

    def end_step(self) -> None:
        """Record the step's members and count it (a step this replica was left out of
        is not counted: its state is replaced at the next quorum)."""
        if not self.members:
            return
        self.history.append(list(self.members))
        self.step += 1

    def close(self) -> None:
        """Stop beating and leave the group (the replica's own default group is the
        caller's)."""
        self._stop.set()
        self._drop_group()
