"""Hugging Face ``transformers`` models as tensor parallelism reads them, without importing
transformers: a model's own tensor-parallel plan (``config.base_model_tp_plan``) and the
kind of each layer (GPT-2's ``Conv1D`` stores its weight transposed, (in, out)).

A transformers model is recognised by what it carries, not by its class: a ``config``
with a ``base_model_tp_plan`` attribute and a ``base_model_prefix``. ``spmd.tp.megatron``
turns what is read here into placements.

How transformers resolves a plan (``transformers/distributed/mixin.py``,
``init_parallel_plans``, and ``parallel_utils.py``, ``_get_parameter_plan``, v5.24), and
what is mirrored here:

- the plan's keys are relative to the *base model* (``LlamaModel``: the module whose
  ``base_model_prefix`` attribute is itself or absent); a wrapper (``LlamaForCausalLM``)
  holds it as ``model.<base_model_prefix>``, and its plan is the base model's with that
  prefix. Here every base model found among ``named_modules()`` is read with its own
  path as the prefix, so a model wrapped again (a module returning ``.logits``) works too.
- a key matches a module or parameter name whose layer numbers (``.3.``) are written
  ``.*.``, exactly (not a glob); a parameter takes its own key, else its module's.
- keys that match nothing are ignored, as transformers does (it only warns).

Not mirrored: when transformers applies a plan itself it also splits the input embedding
(``embedding_rowwise``, added when the plan is not empty) and the head of a causal LM
(``_tp_plan = {"lm_head": "colwise_gather_output"}`` on the class). Neither is in the
config's plan, and both stay replicated here unless ``megatron(vocab_parallel=True)``
asks for them (for every model it places).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch.nn as nn

__all__ = ["STYLES", "PlanEntry", "inside", "is_conv1d", "layer_kind", "plan_entries",
           "ep_plan_experts"]

# transformers' tensor-parallel styles (ALL_PARALLEL_STYLES in
# transformers/distributed/tensor_parallel.py, v5.25, and the older ones of v4.5x) -> the role
# their parameters play. A style fixes two things: how the parameters are split, and where
# the layer's input and output live and which collectives move them ("_rep",
# "_gather_output": output gathered; "_split_input": input replicated, split locally;
# "local_*": the output left as this rank's tensor; "unit_*": heads kept whole; "all_reduce",
# "gather", "sequence_parallel": a module's output reduced, gathered or split along the
# sequence). In spmd only the first is the user's: the compiler derives every activation's
# placement and the collectives from the parameters' (exactly, whatever the split), so
# styles that differ only in the second mean the same here. Roles (spmd.tp's _SPLITS):
# "column" splits the output features (Shard(ndim - 2); a bias Shard(0)), "row" the input
# features (Shard(ndim - 1); a bias stays whole), "packed_column"/"packed_row" the same for a
# weight that packs two projections (gate and up) side by side: StridedShard(.., 2), each
# rank its part of both; "vocabulary"/"embedding" a table's rows/columns; "whole" keeps the
# parameters replicated. A replicated parameter's gradient is always reduced over the ranks
# it is replicated on (what "replicated_with_grad_allreduce" and "mla_kv_a_proj" add).
STYLES: dict[str, str] = {
    "colwise": "column",
    "colwise_rep": "column",
    "colwise_gather_output": "column",
    "local_colwise": "column",
    "unit_colwise": "column",
    "rowwise": "row",
    "rowwise_rep": "row",
    "rowwise_split_input": "row",
    "local_rowwise": "row",
    "unit_rowwise": "row",
    "packed_colwise": "packed_column",
    "packed_rowwise": "packed_row",
    "local_packed_rowwise": "packed_row",
    "embedding_rowwise": "vocabulary",  # the table's rows (vocabulary): Shard(0)
    "embedding_colwise": "embedding",   # the table's columns (embedding): Shard(1)
    "replicate": "whole",
    "replicated_with_grad_allreduce": "whole",
    # a projection whose output splits into a part that meets a column-parallel layer and a
    # part (the rotary keys) that does not: the weight stays whole
    "mla_kv_a_proj": "whole",
    # styles on a module, about its output, not its parameters: a parameter of the module
    # without a key of its own stays whole, as transformers leaves it
    "all_reduce": "whole",
    "gather": "whole",
    "sequence_parallel": "whole",   # megatron(sequence_parallel=True) splits these outputs
    "local_params": "whole",        # the module's own keyed parameters are split by theirs
    "local": "whole",
    "isolated": "whole",            # whole parameters, the output summed: the same values
    "moe_tp_experts": "whole",      # the experts' weights are split by their own keys
    "moe_identity_expert": "whole",
}

# the styles of expert parallelism (transformers' base_model_ep_plan): experts split by
# expert index, tokens dispatched to them. Not read as tensor parallelism (a tensor-parallel
# plan naming one is refused); spmd.ep.experts() reads them from base_model_ep_plan
# (ep_plan_experts): an "ep_dispatch_experts" module, or the module of "grouped_gemm" weights
_EP_MODULE_STYLES = ("ep_dispatch_experts",)
_EP_WEIGHT_STYLES = ("grouped_gemm",)
_REFUSED: dict[str, str] = {
    "ep_router": "expert-parallel routing",
    "ep_dispatch_experts": "expert-parallel dispatch of tokens to the ranks holding experts",
    "grouped_gemm": "experts split by expert index and run as one grouped matrix product",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanEntry:
    """One parameter a model's own plan places.

    Attributes:
        param: its name in the model given to ``megatron()``.
        pattern: the plan key that matched, relative to the base model.
        style: the plan's style for it; its role is ``STYLES[style]``.
        base: the base model's path in the given model ('' where it is the model).
        config: the config class that holds the plan (for messages).
    """

    param: str
    pattern: str
    style: str
    base: str
    config: str

    @property
    def role(self) -> str:
        return STYLES[self.style]

    def describe(self) -> str:
        return f"{self.config}.base_model_tp_plan[{self.pattern!r}] = {self.style!r}"


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (GPT-2's linear layer, weight stored
    (in_features, out_features)). Without transformers imported, nothing can be one."""
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    conv1d = getattr(pytorch_utils, "Conv1D", None)
    return conv1d is not None and isinstance(module, conv1d)


def layer_kind(module: nn.Module) -> str | None:
    """'linear' (``nn.Linear``, weight (out, in)), 'conv1d' (weight (in, out)),
    'embedding' (``nn.Embedding``), or None for anything else."""
    if isinstance(module, nn.Linear):
        return "linear"
    if is_conv1d(module):
        return "conv1d"
    if isinstance(module, nn.Embedding):
        return "embedding"
    return None


def _generic(name: str) -> str:
    # transformers' replace_layer_number_by_wildcard: ".3." and a final ".3" become ".*"
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def _base_models(model: nn.Module, attr: str = "base_model_tp_plan",
                 where: str = "spmd.tp.megatron"
                 ) -> Iterator[tuple[str, nn.Module, Mapping[str, str]]]:
    """(path, module, plan) of every transformers base model in ``model`` whose config
    has a non-empty plan ``attr`` (``base_model_tp_plan``, ``base_model_ep_plan``)."""
    for path, module in model.named_modules():
        config = getattr(module, "config", None)
        plan = getattr(config, attr, None)
        prefix = getattr(module, "base_model_prefix", None)
        if not plan or not isinstance(prefix, str):
            continue
        if prefix and getattr(module, prefix, module) is not module:
            continue  # a wrapper (LlamaForCausalLM): its base model comes later in the walk
        if any(getattr(child, "config", None) is config
               and isinstance(getattr(child, "base_model_prefix", None), str)
               for child in module.children()):
            continue  # a wrapper whose prefix names no attribute (Llama4ForCausalLM's
            # "language_model" over its .model): its base model is that child
        if not isinstance(plan, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in plan.items()):
            raise TypeError(f"{where}: {type(config).__name__}.{attr} must map module name "
                            f"patterns to style names, got {plan!r}")
        yield path, module, plan


def _instance_plans(model: nn.Module) -> dict[str, Mapping[str, str]]:
    """path -> the plan transformers keeps on a model instance (``model.tp_plan``, which
    a user may have set), for every module that has one."""
    plans = {}
    for path, module in model.named_modules():
        if getattr(module, "config", None) is None or not hasattr(module, "base_model_prefix"):
            continue
        plan = getattr(module, "tp_plan", None)
        if isinstance(plan, Mapping) and plan:
            plans[path] = plan
    return plans


def _within(path: str, root: str) -> bool:
    return not root or path == root or path.startswith(root + ".")


def inside(path: str, roots: tuple[str, ...]) -> bool:
    """Whether module ``path`` is one of ``roots`` or below one ('' is the whole model)."""
    return any(_within(path, root) for root in roots)


def _check_agrees(entry: PlanEntry, instances: Mapping[str, Mapping[str, str]]) -> None:
    """The model's own ``tp_plan`` (on the base model or a transformers model holding it)
    must not give the entry's pattern another style than the config does."""
    for path, plan in instances.items():
        if not _within(entry.base, path):
            continue
        rel = entry.base[len(path):].lstrip(".")
        key = f"{rel}.{entry.pattern}" if rel else entry.pattern
        theirs = plan.get(key)
        if theirs is not None and theirs != entry.style:
            raise ValueError(
                f"spmd.tp.megatron: {entry.describe()} but the model's tp_plan[{key!r}] (on "
                f"{path or 'the model'}) is {theirs!r}; say which by writing placements by "
                f"name instead, e.g. placements={{'tp': {{'{entry.param}': spmd.Shard(0)}}}}")


def _refuse(entry: PlanEntry) -> None:
    why = _REFUSED.get(entry.style)
    where = f"{entry.base}." if entry.base else ""
    what = (f"an expert-parallel style ({why}), which a tensor-parallel plan does not "
            f"apply: split the experts by expert index with spmd.ep.experts() (which reads "
            f"the model's base_model_ep_plan), or split each expert's weights with "
            f"'colwise'/'rowwise' keys" if why else
            "a style spmd does not know")
    raise ValueError(
        f"spmd.tp.megatron: {entry.describe()}: style {entry.style!r} is {what}. Write "
        f"placements by name instead: {{'tp': {{'{where}{entry.pattern}.weight': "
        f"spmd.Shard(0)}}}} splits an nn.Linear column-parallel, Shard(1) row-parallel, and "
        f"a parameter left out stays replicated. Styles read from a plan: "
        f"{', '.join(STYLES)}")


def _style(plan: Mapping[str, str], name: str) -> tuple[str, str] | None:
    """(pattern, style) for parameter ``name`` (relative to the base model), as
    transformers' ``_get_parameter_plan`` finds it: its own key, else its module's."""
    generic = _generic(name)
    if generic in plan:
        return generic, plan[generic]
    module = generic.rpartition(".")[0]
    if module in plan:
        return module, plan[module]
    return None


def plan_entries(model: nn.Module) -> tuple[list[PlanEntry], tuple[str, ...]]:
    """Every parameter of ``model`` that a transformers plan in it places, and the paths of
    the base models whose plans govern their subtrees ('' for the whole model); nothing
    where ``model`` holds no transformers model with a plan.

    Raises ``ValueError`` naming the style and the pattern for a style with no exact
    placement (:data:`STYLES` lists the ones read), and where the model's own ``tp_plan``
    contradicts its config's plan.
    """
    entries: list[PlanEntry] = []
    governed: list[str] = []
    instances: dict[str, Mapping[str, str]] | None = None
    for base, module, plan in _base_models(model):
        if inside(base, tuple(governed)):
            continue  # a base model inside one already read: the outer plan governs
        governed.append(base)
        config = type(module.config).__name__
        for rel, _ in module.named_parameters():
            found = _style(plan, rel)
            if found is None:
                continue
            entry = PlanEntry(param=f"{base}.{rel}" if base else rel, pattern=found[0],
                              style=found[1], base=base, config=config)
            if entry.style not in STYLES:
                _refuse(entry)
            if instances is None:
                instances = _instance_plans(model)
            _check_agrees(entry, instances)
            entries.append(entry)
    return entries, tuple(governed)


def ep_plan_experts(model: nn.Module) -> dict[str, str]:
    """The experts modules a transformers ``config.base_model_ep_plan`` in ``model``
    splits by expert index (what ``spmd.ep.experts()`` places when it names no modules):
    module path -> the plan entry naming it (``"Config.base_model_ep_plan['layers.*.mlp.
    experts'] = 'ep_dispatch_experts'"``), for each module an ``ep_dispatch_experts`` key
    matches and each module whose parameters a ``grouped_gemm`` key matches; {} where
    no base model in ``model`` has such a plan. Keys match as in a tensor-parallel plan
    (relative to the base model, layer numbers as ``*``); the plan's other styles
    (tensor-parallel ones for dense layers over the expert ranks, a replicated norm) are
    not read: spmd splits every other parameter by the strategy."""
    found: dict[str, str] = {}
    governed: list[str] = []
    for base, module, plan in _base_models(model, "base_model_ep_plan", "spmd.ep.experts"):
        if inside(base, tuple(governed)):
            continue
        governed.append(base)
        config = type(module.config).__name__

        def note(rel: str, key: str) -> None:
            path = f"{base}.{rel}" if base and rel else base or rel
            found.setdefault(path, f"{config}.base_model_ep_plan[{key!r}] = {plan[key]!r}")

        dispatched = []
        for rel, _ in module.named_modules():
            key = _generic(rel)
            if rel and plan.get(key) in _EP_MODULE_STYLES:
                note(rel, key)
                dispatched.append(rel)
        for rel, _ in module.named_parameters():
            key = _generic(rel)
            owner = rel.rpartition(".")[0]
            # a weight inside a dispatched module is that module's (a per-expert norm's)
            if plan.get(key) in _EP_WEIGHT_STYLES and not inside(owner, tuple(dispatched)):
                note(owner, key)
    return found
