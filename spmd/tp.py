"""Tensor parallelism: where parameters live on the named dimensions of a mesh, written as
glob patterns over parameter names, the way JAX users write partition specs.

    mesh = spmd.Mesh((2, 2), dim_names=("dp", "tp"))
    model = spmd.parallelize(Net(), mesh=mesh, placements={"tp": {
        "layers.*.linear1.weight": spmd.Shard(0),     # column-parallel
        "layers.*.linear1.bias":   spmd.Shard(0),
        "layers.*.linear2.weight": spmd.Shard(1)}})   # row-parallel
    model = spmd.parallelize(Net(), mesh=mesh, placements=spmd.tp.megatron())

A pattern that matches no parameter but modules places those modules' outputs (and
their gradients): ``{"tp": {"layers.*.norm": spmd.Shard(1)}}`` keeps the norms' outputs
sharded along the sequence, which is sequence parallelism
(``spmd.tp.megatron(sequence_parallel=True)`` places every norm and embedding so).

Each parameter placed ``Shard(d)`` is stored as this rank's piece (``model.parameters()``
are the pieces, so an optimizer keeps only its part of the state); the model's code is
unchanged, and the compiler places everything computed from the pieces by the ops'
sharding rules, inserting only the collectives those placements need (a Megatron MLP:
one all-reduce in forward, one in backward). ``state_dict()`` gives whole tensors and
``load_state_dict`` takes whole tensors or this rank's pieces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch.nn as nn

from spmd.hf import inside, layer_kind, plan_entries
from spmd.lowering.placements import Placement, Shard, StridedShard
from spmd.lowering.strategy import tp_dims_of
from spmd.state.resolve import layout_options, resolve_layout, resolve_placements

__all__ = ["megatron", "Preset", "Resolved", "resolve_placements", "resolve_layout",
           "sequence_modules", "vocabulary_layers", "tp_dims_of", "layout_options", "COLUMN",
           "ROW"]

# Megatron-LM's layer names (and the common ones of Hugging Face and torch models):
# column-parallel layers split their output features, row-parallel their input features.
# A fused query-key-value projection (GPT-2's "c_attn", FUSED) holds q, k and v side by
# side along its output: a contiguous split would give rank 0 all of q and half of k, so
# it is split by head groups, StridedShard(out, 3): each rank its heads of each of q, k
# and v; torch's nn.MultiheadAttention's in_proj_weight the same way (its forward then
# merges the batch with each rank's heads in a reshape: a StridedShard of the batch).
COLUMN = ("q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv", "q", "k",
          "v", "fc1", "linear1", "w1", "w3", "up_proj", "gate_proj", "c_fc",
          "dense_h_to_4h", "ff1", "mlp_in", "in_proj", "Wq", "Wk", "Wv", "project_q",
          "project_k", "project_v")
ROW = ("o_proj", "out_proj", "wo", "o", "proj", "fc2", "linear2", "w2", "down_proj", "c_proj",
       "dense_4h_to_h", "ff2", "mlp_out", "dense", "attention_out")
# fused projections of q, k and v of equal sizes, concatenated along the output
FUSED = ("c_attn",)

# (role, layer kind) -> the layer's parameters that are split; the others stay replicated.
# nn.Linear stores its weight (out, in), transformers' Conv1D (GPT-2) (in, out).
_SPLITS: dict[tuple[str, str], dict[str, Placement]] = {
    ("column", "linear"): {"weight": Shard(0), "bias": Shard(0)},
    ("column", "conv1d"): {"weight": Shard(1), "bias": Shard(0)},
    ("row", "linear"): {"weight": Shard(1)},
    ("row", "conv1d"): {"weight": Shard(0)},
    ("vocabulary", "embedding"): {"weight": Shard(0)},
    ("fused", "linear"): {"weight": StridedShard(0, 3), "bias": StridedShard(0, 3)},
    ("fused", "conv1d"): {"weight": StridedShard(1, 3), "bias": StridedShard(0, 3)},
    ("embedding", "embedding"): {"weight": Shard(1)},
    ("packed_column", "linear"): {"weight": StridedShard(0, 2), "bias": StridedShard(0, 2)},
    ("packed_column", "conv1d"): {"weight": StridedShard(1, 2), "bias": StridedShard(0, 2)},
    ("packed_row", "linear"): {"weight": StridedShard(1, 2)},
    ("packed_row", "conv1d"): {"weight": StridedShard(0, 2)},
}


def _by_rank(role: str, ndim: int) -> Placement | None:
    """A role's placement for a parameter that is not an nn.Linear's, Conv1D's or
    nn.Embedding's (a module's own tensor: an MoE's experts (experts, out, in), attention
    sinks (heads,)), by its number of dimensions as transformers splits it: the output
    features are the second to last dimension, the input features the last; a vector is
    split as a bias (column) or left whole (row). None: left whole."""
    if ndim == 0 or role == "whole":
        return None
    out, inp = max(ndim - 2, 0), ndim - 1
    return {"column": Shard(out),
            "row": Shard(inp) if ndim > 1 else None,
            "packed_column": StridedShard(out, 2),
            "packed_row": StridedShard(inp, 2) if ndim > 1 else None,
            "vocabulary": Shard(0),
            "embedding": Shard(ndim - 1)}[role]

Spec = Mapping[str, Mapping[str, Placement]]


class Resolved(dict):
    """What :func:`megatron` gives for a model: ``{dim: {parameter name: placement}}``
    (every parameter not named stays replicated), with ``source``: each named parameter ->
    where its placement came from, e.g. ``"LlamaConfig.base_model_tp_plan[
    'layers.*.self_attn.q_proj'] = 'colwise'"`` or ``"name: column-parallel Linear
    'q_proj'"``."""

    def __init__(self, placed: Mapping[str, Mapping[str, Placement]], *,
                 source: Mapping[str, str]) -> None:
        super().__init__(placed)
        self.source = dict(source)


@dataclass(frozen=True)
class Preset:
    """Placements decided from the model when it is parallelized (``megatron()``)."""

    name: str
    dim: str
    sequence_parallel: bool = False
    sequence_dim: int = 1
    vocab_parallel: bool = False
    loss_parallel: bool = False

    @property
    def dims(self) -> tuple[str, ...]:
        return (self.dim,)

    def resolve(self, model: nn.Module) -> dict[str, dict[str, Placement]]:
        if self.name == "megatron":
            return megatron(model, dim=self.dim, sequence_parallel=self.sequence_parallel,
                            sequence_dim=self.sequence_dim, vocab_parallel=self.vocab_parallel,
                            loss_parallel=self.loss_parallel)
        raise ValueError(f"unknown preset {self.name!r}")


# norms whose output sequence parallelism shards along the sequence: torch's and every
# class named like Hugging Face's (LlamaRMSNorm, Qwen2RMSNorm, ...) or ours
_NORMS = (nn.LayerNorm, nn.RMSNorm)
_NORM_NAMES = ("LayerNorm", "RMSNorm")


def sequence_modules(model: nn.Module) -> dict[str, str]:
    """The modules whose outputs Megatron's sequence parallelism keeps sharded along the
    sequence: every layer norm and RMS norm (what runs between the split layers) and every
    embedding (so the residual stream starts sharded), each -> why."""
    found: dict[str, str] = {}
    for path, module in model.named_modules():
        if not path:
            continue
        if isinstance(module, _NORMS) or type(module).__name__.endswith(_NORM_NAMES):
            found[path] = f"sequence parallelism: the output of a {type(module).__name__}"
        elif layer_kind(module) == "embedding":
            found[path] = "sequence parallelism: the residual stream starts at an embedding"
    return found


_HEADS = ("head", "lm_head", "output")


def vocabulary_layers(model: nn.Module) -> dict[str, str]:
    """The token embedding(s) and the vocabulary head(s) of ``model``, each module path ->
    what it is. The vocabulary is the largest ``nn.Embedding``'s row count; embeddings of
    that many rows are token tables (a position table has fewer), and an ``nn.Linear``
    named one of ``head``, ``lm_head``, ``output`` with that many outputs is the head."""
    embeddings = {p: m for p, m in model.named_modules() if layer_kind(m) == "embedding"}
    if not embeddings:
        return {}
    vocab = max(m.num_embeddings for m in embeddings.values())
    found = {p: f"vocabulary-parallel: a token embedding of {vocab} rows"
             for p, m in embeddings.items() if m.num_embeddings == vocab}
    for path, module in model.named_modules():
        if (isinstance(module, nn.Linear) and module.out_features == vocab
                and path.rsplit(".", 1)[-1] in _HEADS):
            found[path] = f"vocabulary-parallel: the head onto {vocab} tokens"
    return found


def megatron(model: Any = None, *, dim: str = "tp", sequence_parallel: bool = False,
             sequence_dim: int = 1, vocab_parallel: bool = False,
             loss_parallel: bool = False) -> Any:
    """Megatron-LM's tensor parallelism for a transformer: in each block, the query, key
    and value projections and the MLP's first linear layer(s) column-parallel, the
    attention's output projection and the MLP's second linear layer row-parallel.

    Where the layers come from, in order:

    1. A Hugging Face ``transformers`` model whose config has a ``base_model_tp_plan``
       (LLaMA, Mistral, Qwen2, ...): the model's own plan, resolved as transformers
       resolves it (see :mod:`spmd.hf`). Inside that base model the plan wins and names
       are not matched. ``'colwise'`` is weight and bias ``Shard(0)``, ``'rowwise'``
       weight ``Shard(1)`` with the bias replicated; :data:`spmd.hf.STYLES` lists the
       other styles read (those that differ from these only in where activations live,
       which spmd's compiler decides); any other style raises ``ValueError`` naming it.
    2. Elsewhere, by name: ``nn.Linear`` or transformers ``Conv1D`` children named one of
       :data:`COLUMN` are column-parallel (``Linear``: weight and bias ``Shard(0)``;
       ``Conv1D``, whose weight is (in, out): weight ``Shard(1)``, bias ``Shard(0)``),
       and those named one of :data:`ROW` row-parallel (``Linear``: weight ``Shard(1)``;
       ``Conv1D``: weight ``Shard(0)``; biases replicated) where a column-parallel
       sibling feeds them. GPT-2's fused ``c_attn`` is left replicated (see
       :data:`COLUMN`), so GPT-2 splits its MLPs.

    With ``sequence_parallel=True`` (Megatron-LM's sequence parallelism, torch's
    ``SequenceParallel``), the outputs of every norm and embedding
    (:func:`sequence_modules`) are placed ``Shard(sequence_dim)``: norms, dropout and
    residual adds run on 1/tp of the sequence, a row-parallel layer's all-reduce becomes
    a reduce-scatter into the sequence shards and a column-parallel layer's input an
    all-gather (the same bytes on the wire), so activation memory outside the split
    layers is 1/tp. An output with no dimension after ``sequence_dim`` (a position
    table of shape (sequence, hidden)) is left where the compiler puts it.

    With ``vocab_parallel=True`` (Megatron-LM's ``VocabParallelEmbedding``; what
    transformers adds when it applies a plan), the token embedding's table is split along
    its rows (``Shard(0)``: each rank looks up the tokens of its range and the others read
    as zeros, summed by one all-reduce, or a reduce-scatter with sequence parallelism).
    The vocabulary head stays replicated: split by columns its logits would come out split
    along the vocabulary, and the caller's loss needs them whole (a gather of the largest
    activation of the step; measured: +45% step peak and 1.3x the step time at a 32k
    vocabulary) until a loss on split logits exists. A head tied to the table (GPT-2) is
    the same parameter, so it is split with it. :func:`vocabulary_layers` lists the tables
    and heads.

    Args:
        model: an ``nn.Module`` instance: its placements, a :class:`Resolved`
            ``{dim: {name: placement}}`` whose ``source`` says where each came from;
            None (or a class): a :class:`Preset` resolved against the model
            ``parallelize`` or ``inspect`` is given.
        dim: the mesh dimension to split along.
        sequence_parallel: also shard the activations between the split layers along
            the sequence.
        sequence_dim: the sequence's dimension in those activations (1 for
            ``(batch, sequence, hidden)``; 0 for ``batch_first=False`` models).
        vocab_parallel: also split the token embedding's table along the vocabulary.
        loss_parallel: also split the vocabulary head(s) along the vocabulary (weight and
            bias ``Shard(0)``): logits come out split, and a cross-entropy inside the
            compiled step runs on them without gathering them (torch's
            ``loss_parallel``); a module's caller receives them gathered.

    Example::

        placed = spmd.tp.megatron(LlamaForCausalLM(config))
        placed["tp"]["model.layers.0.self_attn.o_proj.weight"]  # Shard(dim=1)
        placed.source["model.layers.0.self_attn.o_proj.weight"]
        # "LlamaConfig.base_model_tp_plan['layers.*.self_attn.o_proj'] = 'rowwise'"
    """
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"spmd.tp.megatron: sequence_parallel must be a bool, got "
                        f"{sequence_parallel!r}")
    if not isinstance(loss_parallel, bool):
        raise TypeError(f"spmd.tp.megatron: loss_parallel must be a bool, got "
                        f"{loss_parallel!r}")
    if not isinstance(vocab_parallel, bool):
        raise TypeError(f"spmd.tp.megatron: vocab_parallel must be a bool, got "
                        f"{vocab_parallel!r}")
    if not isinstance(sequence_dim, int) or isinstance(sequence_dim, bool) or sequence_dim < 0:
        raise ValueError(f"spmd.tp.megatron: sequence_dim must be a non-negative int, got "
                         f"{sequence_dim!r}")
    if model is None or isinstance(model, type):
        return Preset("megatron", dim, sequence_parallel, sequence_dim, vocab_parallel,
                      loss_parallel)
    if not isinstance(model, nn.Module):
        raise TypeError(f"spmd.tp.megatron: expected an nn.Module (or nothing), got "
                        f"{type(model).__name__}")
    placed: dict[str, Placement] = {}
    source: dict[str, str] = {}
    entries, governed = plan_entries(model)
    for entry in entries:
        path, _, local = entry.param.rpartition(".")
        layer = model.get_submodule(path)
        split = _SPLITS.get((entry.role, layer_kind(layer) or ""))
        if split is not None:
            placement = split.get(local)
        elif entry.pattern.rpartition(".")[2] == local or entry.role == "whole":
            # a key of the parameter itself (an MoE's experts, attention sinks)
            placement = _by_rank(entry.role, getattr(layer, local).dim())
        else:  # a key of a module whose kind the style does not split
            raise ValueError(f"spmd.tp.megatron: {entry.describe()} places {entry.param}, a "
                             f"parameter of a {type(layer).__name__}; {entry.style!r} splits "
                             f"nn.Linear and Conv1D layers (embedding_* styles nn.Embedding) "
                             f"and parameters named by their own key; write placements by "
                             f"name instead")
        if placement is not None:
            placed[entry.param] = placement
            source[entry.param] = entry.describe()
    for prefix, module in model.named_modules():
        if inside(prefix, governed):
            continue  # a model's own plan places this part
        base = f"{prefix}." if prefix else ""
        if isinstance(module, nn.MultiheadAttention) and module._qkv_same_embed_dim:
            for local, placement in (("in_proj_weight", StridedShard(0, 3)),
                                     ("in_proj_bias", StridedShard(0, 3)),
                                     ("out_proj.weight", Shard(1))):
                if _has(module, local):
                    placed[f"{base}{local}"] = placement
                    source[f"{base}{local}"] = (
                        "name: nn.MultiheadAttention's fused q, k, v projection, split by "
                        "head groups" if "in_proj" in local else
                        "name: row-parallel out_proj of an nn.MultiheadAttention")
            continue
        layers = {name: child for name, child in module.named_children()
                  if layer_kind(child) in ("linear", "conv1d")}
        columns = [n for n in layers if n in COLUMN]
        fused = [n for n in layers if n in FUSED]
        if not columns and not fused:
            continue
        rows = [n for n in layers if n in ROW]
        for role, names in (("column", columns), ("row", rows), ("fused", fused)):
            for name in names:
                kind = layer_kind(layers[name])
                for local, placement in _SPLITS[(role, kind)].items():
                    if getattr(layers[name], local, None) is not None:
                        placed[f"{base}{name}.{local}"] = placement
                        source[f"{base}{name}.{local}"] = (
                            f"name: fused q, k, v {type(layers[name]).__name__} {name!r}, "
                            f"split by head groups" if role == "fused" else
                            f"name: {role}-parallel {type(layers[name]).__name__} {name!r}")
    if not placed:
        raise ValueError(f"spmd.tp.megatron: no column-parallel layer found in "
                         f"{type(model).__name__} (nn.Linear or transformers Conv1D children "
                         f"named one of {', '.join(COLUMN)}, or a transformers config's "
                         f"base_model_tp_plan); write placements by name instead")
    if vocab_parallel:
        found = {path: why for path, why in vocabulary_layers(model).items()
                 if layer_kind(model.get_submodule(path)) == "embedding"}
        if not found:
            raise ValueError(f"spmd.tp.megatron: vocab_parallel=True, but "
                             f"{type(model).__name__} has no nn.Embedding")
        names = dict(model.named_parameters())  # a tied head's weight is the embedding's
        for path, why in found.items():
            for local in ("weight", "bias"):
                if f"{path}.{local}" in names:
                    placed[f"{path}.{local}"] = Shard(0)
                    source[f"{path}.{local}"] = why
    if loss_parallel:
        heads = [path for path in vocabulary_layers(model)
                 if isinstance(model.get_submodule(path), nn.Linear)]
        if not heads:
            raise ValueError(f"spmd.tp.megatron: loss_parallel=True, but "
                             f"{type(model).__name__} has no vocabulary head (an nn.Linear "
                             f"named one of {', '.join(_HEADS)} with as many outputs as the "
                             f"largest nn.Embedding has rows)")
        by_tensor = {id(t): n for n, t in model.named_parameters()}  # a tied head: the table
        for path in heads:
            for local in ("weight", "bias"):
                t = getattr(model.get_submodule(path), local, None)
                if t is not None and id(t) in by_tensor:
                    placed[by_tensor[id(t)]] = Shard(0)
                    source[by_tensor[id(t)]] = ("loss parallelism: the head split along the "
                                                "vocabulary, its logits with it")
    if sequence_parallel:
        for path, why in sequence_modules(model).items():
            placed[path] = Shard(sequence_dim)
            source[path] = why
    return Resolved({dim: placed}, source=source)


def _has(module: nn.Module, path: str) -> bool:
    """Whether ``module`` has a parameter (not None) at dotted ``path``."""
    owner, _, name = path.rpartition(".")
    target = module.get_submodule(owner) if owner else module
    return getattr(target, name, None) is not None
