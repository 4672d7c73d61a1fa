"""Context parallelism: the sequence split across the ranks of a mesh dimension, attention
run as ring attention.

    mesh = spmd.Mesh((2, 2), dim_names=("dp", "cp"))
    model = spmd.parallelize(Net(), mesh=mesh, placements=spmd.cp.ring())
    mesh = spmd.Mesh((2, 2, 2), dim_names=("fsdp", "cp", "tp"))
    model = spmd.parallelize(Net(), mesh=mesh, strategy="fsdp",
                             placements=[spmd.tp.megatron(), spmd.cp.ring()])

Every rank of a "cp" group is given the same batch (as the ranks of a "tp" group are);
the compiler places the token embedding's output ``Shard(1)`` along "cp" and the ops'
rules carry the split through the model: linear layers, norms, residual adds and the
MLP run on each rank's part of the sequence, values computed from positions (rotary
tables, position ids) are computed whole and sliced where they meet it, and scaled
dot-product attention with queries, keys and values sharded along the sequence becomes
``spmd::ring_attention`` (:mod:`spmd.lowering.ring`): key/value blocks passed around
the ring with send/recv, overlapped with each block's kernel, merged by the online
softmax; causal attention load-balanced as torch's ``context_parallel`` does. Parameter
gradients, each rank's sum over its part of the sequence, are summed over "cp".
What the caller receives (a module's output) is whole, gathered along the sequence; a
loss computed inside the compiled step (``spmd.parallelize`` of a step function) is
reduced instead, and the logits are never gathered.

Nothing is guessed: an op whose rule cannot keep the sequence split (a reshape that
merges the batch with a split sequence, an explicit attention mask, attention dropout)
gathers its inputs first, and the plan says so at that node
(``plan.explain(...)``, ``plan.collectives``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from spmd.hf import layer_kind
from spmd.lowering.placements import Placement, Shard

__all__ = ["ring", "ContextParallel", "token_embeddings"]


def token_embeddings(model: nn.Module) -> dict[str, str]:
    """The token embedding(s) of ``model`` (the ``nn.Embedding`` s with the most rows; a
    position table has fewer), each module path -> why its output starts the split."""
    tables = {p: m for p, m in model.named_modules() if layer_kind(m) == "embedding"}
    if not tables:
        return {}
    vocab = max(m.num_embeddings for m in tables.values())
    return {p: f"context parallelism: the sequence is split from the token embedding "
               f"({vocab} rows) on"
            for p, m in tables.items() if m.num_embeddings == vocab}


@dataclass(frozen=True)
class ContextParallel:
    """Context parallelism along ``dim``, resolved against the model being parallelized
    (:func:`ring`)."""

    dim: str = "cp"
    sequence_dim: int = 1
    load_balance: bool = True
    modules: tuple[str, ...] = ()

    @property
    def dims(self) -> tuple[str, ...]:
        return (self.dim,)

    def resolve(self, model: nn.Module) -> dict[str, dict[str, Placement]]:
        found = dict(token_embeddings(model)) if not self.modules else {
            m: "context parallelism: named by the caller" for m in self.modules}
        if not found:
            raise ValueError(f"spmd.cp.ring: {type(model).__name__} has no nn.Embedding to "
                             f"split the sequence from; name the module whose output "
                             f"starts it: spmd.cp.ring(modules=('embed',))")
        return {self.dim: {path: Shard(self.sequence_dim) for path in found}}

    def options(self) -> dict[str, dict[str, Any]]:
        return {"load_balance": {self.dim: self.load_balance}}


def ring(*, dim: str = "cp", sequence_dim: int = 1, load_balance: bool = True,
         modules: tuple[str, ...] | list[str] = ()) -> ContextParallel:
    """Context parallelism with ring attention along mesh dimension ``dim``.

    Args:
        dim: the mesh dimension the sequence is split over.
        sequence_dim: the sequence's dimension in the activations (1 for
            ``(batch, sequence, hidden)``).
        load_balance: under a causal mask, exchange halves of the sequence in each
            attention so that every rank does the same work (rank ``r`` attends chunks
            ``r`` and ``2n - 1 - r`` of ``2n``); the graph around attention keeps the
            contiguous split. Needs an even local sequence; falls back to contiguous
            blocks (rank ``n - 1`` then does ``n`` blocks of work, rank 0 one) otherwise.
        modules: module paths (or glob patterns) whose outputs start the split; default
            the token embedding(s) (:func:`token_embeddings`).

    Pass it as ``placements=``, alone or in a list with tensor parallelism:
    ``placements=[spmd.tp.megatron(), spmd.cp.ring()]``.
    """
    if not isinstance(dim, str) or not dim:
        raise TypeError(f"spmd.cp.ring: dim must be a mesh dimension's name, got {dim!r}")
    if not isinstance(sequence_dim, int) or isinstance(sequence_dim, bool) or sequence_dim < 0:
        raise ValueError(f"spmd.cp.ring: sequence_dim counts from the front (1 for (batch, "
                         f"sequence, hidden)), got {sequence_dim!r}")
    if not isinstance(load_balance, bool):
        raise TypeError(f"spmd.cp.ring: load_balance must be a bool, got {load_balance!r}")
    if isinstance(modules, str) or not all(isinstance(m, str) for m in modules):
        raise TypeError(f"spmd.cp.ring: modules must be a sequence of module paths, got "
                        f"{modules!r}")
    return ContextParallel(dim=dim, sequence_dim=sequence_dim, load_balance=load_balance,
                           modules=tuple(modules))
