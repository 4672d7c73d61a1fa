"""``spmd.ep``'s presets: which modules are experts (:func:`find_experts`), the
expert-parallel preset (:func:`experts`, :class:`ExpertParallel`) and the expert
tensor-parallel placements it adds (:class:`ExpertTensorParallel`)."""

from __future__ import annotations

import fnmatch
import inspect
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn as nn

def _weights(module: nn.Module) -> tuple[str, ...]:
    """The stacked expert parameters of an experts module (its first dimension is the
    expert index), or () for any other module."""
    own = module._parameters  # (a placed module reads some through properties)
    up = "gate_up_proj" if isinstance(own.get("gate_up_proj"), nn.Parameter) else "up_proj"
    names = [up, "down_proj"]
    params = [own.get(n) for n in names]
    if not all(isinstance(p, nn.Parameter) and p.dim() == 3 for p in params):
        return ()
    experts = params[0].shape[0]
    if params[1].shape[0] != experts:
        return ()
    for n in list(names):
        if isinstance(own.get(f"{n}_bias"), nn.Parameter):
            names.append(f"{n}_bias")
    return tuple(names)


def _routed(module: nn.Module) -> bool:
    """Its forward takes the routing: ``forward(hidden, top_k_index, top_k_weights)``
    (a module whose experts are applied another way, e.g. Llama 4's to tokens already
    repeated per expert, or a stacked shared expert, is not one)."""
    if type(module).forward is nn.Module.forward:
        return False  # no forward of its own (a pipeline stage's holder of parameters)
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in params)


def unsupported(module: nn.Module) -> str:
    """Why the expert-parallel forward cannot stand in for ``module``'s own ('' if it
    can): parameters beyond the stacked expert weights (a per-expert norm inside it), or
    a class that overrides the decorated experts forward with logic of its own."""
    known = set(_weights(module))
    extra = [n for n, _ in module.named_parameters() if n not in known]
    if extra:
        return (f"it holds parameters besides its experts' stacked weights ({', '.join(extra)}), "
                f"which the expert-parallel forward would not apply")
    cls = type(module)
    own = cls.__dict__.get("forward")
    decorated = [c for c in cls.__mro__[1:] if hasattr(c.__dict__.get("forward"), "__wrapped__")]
    if own is not None and decorated and not hasattr(own, "__wrapped__"):
        return (f"{cls.__name__}.forward overrides the experts forward of "
                f"{decorated[0].__name__} with code of its own, which the expert-parallel "
                f"forward would not run")
    return ""


def find_experts(model: nn.Module, patterns: tuple[str, ...] = ()) -> dict[str, nn.Module]:
    """The experts modules of ``model`` (path -> module): those shaped as the module doc
    says (stacked expert weights, a forward that takes the routing), or among those the
    ones whose paths match ``patterns``. Without ``patterns``, a transformers model that
    declares its experts (``config.base_model_ep_plan``, :func:`spmd.hf.ep_plan_experts`)
    gets those; ``ValueError`` naming the plan's entry where one is not shaped so."""
    if not patterns:
        from spmd.hf import ep_plan_experts

        planned = ep_plan_experts(model)
        if planned:
            out = {}
            for path, entry in planned.items():
                module = model.get_submodule(path) if path else model
                if not (_weights(module) and _routed(module)):
                    raise ValueError(
                        f"spmd.ep.experts: {entry} names {path} ({type(module).__name__}), "
                        f"which is not an experts module spmd can split by expert (stacked "
                        f"gate_up_proj or up_proj and down_proj of shape (experts, ...), "
                        f"forward(hidden, top_k_index, top_k_weights)); name the modules "
                        f"with spmd.ep.experts(modules=[...])")
                out[path] = module
            return out
    found = {}
    for path, module in model.named_modules():
        if patterns and not any(fnmatch.fnmatchcase(path, p) for p in patterns):
            continue
        if _weights(module) and _routed(module):
            found[path] = module
    return found


# a dropless layer's default headroom (spmd.ep.experts): its received rows bounded at
# twice what even routing brings; a forward whose routing brings more runs again
DEFAULT_HEADROOM = 2.0


@dataclass(frozen=True)
class ExpertParallel:
    """Expert parallelism along data dimension ``dim`` (:func:`experts`), and expert
    tensor parallelism along ``tensor_parallel`` (:class:`ExpertTensorParallel`)."""

    dim: str | None = None
    modules: tuple[str, ...] = ()
    tensor_parallel: str | None = None
    # a pipeline stage's expert parameters, by name (their modules were placed on the
    # whole model before it was traced: spmd.pipeline)
    names: tuple[str, ...] = ()
    capacity_factor: float | None = None
    headroom: float | None = None

    expert_parallel = True  # (how spmd.lowering.options tells it from a tp preset)

    @property
    def dims(self) -> tuple[str, ...]:
        """The tensor-parallel dimensions it names (spmd.tp.tp_dims_of): the expert
        tensor-parallel one; not ``dim``, which the batch is split along."""
        return (self.tensor_parallel,) if self.tensor_parallel else ()

    def resolve(self, model: nn.Module) -> dict[str, Any]:
        return {}

    def parameters(self, model: nn.Module, size: int, where: str, dim: str | None = None
                   ) -> dict[str, str]:
        """Each expert parameter's name -> the module holding it; ``ValueError`` naming a
        layer whose experts do not divide over ``size`` ranks, or a model without any."""
        if self.names:  # a pipeline stage's, checked on the whole model
            return {name: name.rpartition(".")[0] for name in self.names}
        found = find_experts(model, self.modules)
        if not found:
            what = (f"no module matching {list(self.modules)} is" if self.modules
                    else "no module of it is")
            raise ValueError(
                f"{where}: spmd.ep.experts: {what} an experts module ({type(model).__name__}); "
                f"one holds stacked gate_up_proj (or up_proj) and down_proj parameters of "
                f"shape (experts, ...) and takes forward(hidden, top_k_index, top_k_weights)")
        out: dict[str, str] = {}
        for path, module in found.items():
            why = unsupported(module)
            if why:
                raise ValueError(f"{where}: spmd.ep.experts: {path} ({type(module).__name__}) "
                                 f"cannot be split by expert: {why}; leave it whole by naming "
                                 f"the others with spmd.ep.experts(modules=[...])")
            count = getattr(module, _weights(module)[0]).shape[0]
            if count % size:
                raise ValueError(f"{where}: spmd.ep.experts: {path} has {count} experts, "
                                 f"which do not divide over the {size} ranks of "
                                 f"{dim or self.dim or 'the data dimension'!r}")
            for name in _weights(module):
                out[f"{path}.{name}" if path else name] = path
        return out


@dataclass(frozen=True)
class ExpertTensorParallel:
    """Expert tensor parallelism (Megatron-Core's ``expert_tensor_parallel_size``,
    torchtitan's ``ExpertTensorParallel``): each expert's weights split by their features
    along tensor-parallel dimension ``dim``, as a Megatron MLP's, placements the compiler
    plans like any other (what :func:`experts` adds with ``tensor_parallel=``).

    - ``gate_up_proj`` column-parallel: split by its output features, each rank its part
      of the gate and its part of the up projection (``StridedShard(out, 2)``: the two
      halves split alike, so ``chunk(2)`` pairs them); a gate that pairs adjacent columns
      (GPT-OSS's interleaved ``gate_up[..., ::2]``, found by probing the module's
      ``_apply_gate``) ``Shard(out)``, which keeps each pair on one rank; ``up_proj``
      (no gate) ``Shard(out)``.
    - ``down_proj`` row-parallel: split by its input features; the rows' partial sums go
      back by the all-to-all as they are and are reduced once, after the combine.
    - biases: split as their weight's output features; ``down_proj_bias`` whole.
    """

    dim: str
    modules: tuple[str, ...] = ()

    @property
    def dims(self) -> tuple[str, ...]:
        return (self.dim,)

    def resolve(self, model: nn.Module) -> dict[str, dict[str, Any]]:
        from spmd.lowering.placements import Shard, StridedShard

        placed: dict[str, Any] = {}
        for path, module in find_experts(model, self.modules).items():
            transposed = bool(getattr(module, "is_transposed", False))
            out_dim, in_dim = (2, 1) if transposed else (1, 2)
            names = _weights(module)
            up = names[0]
            packed = up == "gate_up_proj" and _gate_pairs(module) != "adjacent"
            columns = StridedShard(out_dim, 2) if packed else Shard(out_dim)
            base = f"{path}." if path else ""
            placed[f"{base}{up}"] = columns
            placed[f"{base}down_proj"] = Shard(in_dim)
            if f"{up}_bias" in names:
                placed[f"{base}{up}_bias"] = StridedShard(1, 2) if packed else Shard(1)
        return {self.dim: placed}


def _gate_pairs(module: nn.Module) -> str:
    """Which columns of ``gate_up`` the module's gate pairs: ``"halves"`` (column ``i``
    with ``I + i``, ``chunk(2)``), ``"adjacent"`` (``2i`` with ``2i + 1``) or ``""``
    (unknown), read from what each output of ``_apply_gate`` on 4 columns depends on."""
    gate = getattr(module, "_apply_gate", None)
    if gate is None:
        return "halves"  # the experts forward's own chunk(2)
    probe = torch.linspace(0.1, 0.4, 4, dtype=torch.float64).view(1, 4)
    try:
        jac = torch.autograd.functional.jacobian(lambda t: gate(t).sum(0), probe)
    except Exception:  # a gate that will not run on a probe: unknown
        return ""
    uses = [tuple(bool(v) for v in row) for row in (jac.reshape(2, 4) != 0)]
    if uses == [(True, False, True, False), (False, True, False, True)]:
        return "halves"
    if uses == [(True, True, False, False), (False, False, True, True)]:
        return "adjacent"
    return ""


def experts(*, dim: str | None = None, modules: tuple[str, ...] | list[str] = (),
            tensor_parallel: str | None = None, capacity_factor: float | None = None,
            headroom: float | None = None) -> ExpertParallel:
    """Expert parallelism: each experts module's experts split by expert index over the
    ranks of data dimension ``dim``.

    Args:
        dim: the mesh dimension the experts are split over; one the batch is split along
            (default: the strategy's data dimension, the sharding one for ``fsdp``).
        modules: module paths (or glob patterns) of the experts modules; default every
            module shaped as one (:func:`find_experts`).
        tensor_parallel: a tensor-parallel mesh dimension to split each expert's weights
            along as well (expert tensor parallelism, :class:`ExpertTensorParallel`);
            default: the experts are whole along every tensor-parallel dimension (each
            such rank computes them on the same tokens, as Megatron-Core with
            ``expert_tensor_parallel_size=1``).
        capacity_factor: None (default): dropless, every (token, choice) pair reaches its
            expert however uneven the routing. A number: GShard's and Switch's expert
            capacity, per rank: each expert takes at most ``ceil(capacity_factor * T * k
            / E)`` of each rank's ``T`` tokens' pairs, the first in (token, choice)
            order, and the rest are dropped (the token keeps its other choices and the
            residual); the rows a rank's experts receive, and their memory, are bounded
            by it. :func:`dropped_tokens` says what the last forward dropped.
        headroom: dropless only. The rows a rank's experts receive per layer are padded
            to a static bound in the compiled graph: ``ceil(h · T · k)`` for ``T``
            tokens of top-``k`` per rank, ``h`` times what even routing brings (memory,
            and the elementwise work between the expert products, scale with it). Every
            rank learns, in each layer's routing, whether any rank's experts received
            more (one small all-reduce over the mesh); if so, the forward is run again on
            every rank with that layer's headroom grown to fit (at least doubled, at most
            ``n``, the ranks of ``dim``: every pair of every rank, which no routing
            exceeds; the graph recompiled, the random state restored): still dropless,
            the result the same, only that forward slower. The grown headroom stays, and
            the plan says how often it grew. None (default): :data:`DEFAULT_HEADROOM`
            (2), and in a pipeline every pair of every rank (its stages run a forward at
            different times, so none is run again; a number there is refused).
            ``math.inf``: every pair of every rank (``n · T · k``), never run again.

    Pass it as ``placements=``, alone or in a list with other presets (``spmd.tp.megatron()``
    for the attention).
    """
    if dim is not None and (not isinstance(dim, str) or not dim):
        raise TypeError(f"spmd.ep.experts: dim must be a mesh dimension's name, got {dim!r}")
    if isinstance(modules, str) or not all(isinstance(m, str) for m in modules):
        raise TypeError(f"spmd.ep.experts: modules must be a sequence of module paths, got "
                        f"{modules!r}")
    if tensor_parallel is not None and (not isinstance(tensor_parallel, str)
                                        or not tensor_parallel):
        raise TypeError(f"spmd.ep.experts: tensor_parallel must be a mesh dimension's name, "
                        f"got {tensor_parallel!r}")
    if tensor_parallel is not None and tensor_parallel == dim:
        raise ValueError(f"spmd.ep.experts: tensor_parallel={tensor_parallel!r} is the "
                         f"experts' own dimension; name another")
    if capacity_factor is not None and (isinstance(capacity_factor, bool) or not isinstance(
            capacity_factor, (int, float)) or not capacity_factor > 0):
        raise ValueError(f"spmd.ep.experts: capacity_factor must be a positive number (or "
                         f"None: dropless), got {capacity_factor!r}")
    if headroom is not None and (isinstance(headroom, bool) or not isinstance(
            headroom, (int, float)) or not headroom >= 1):
        raise ValueError(f"spmd.ep.experts: headroom must be a number >= 1 (the rows a "
                         f"rank's experts receive, in units of what even routing brings; "
                         f"math.inf: every pair of every rank), or None (the default), got "
                         f"{headroom!r}")
    if headroom is not None and capacity_factor is not None:
        raise ValueError(f"spmd.ep.experts: headroom={headroom} bounds a dropless layer's "
                         f"rows; capacity_factor={capacity_factor} already bounds them (by "
                         f"dropping): pass one")
    return ExpertParallel(dim=dim, modules=tuple(modules), tensor_parallel=tensor_parallel,
                          capacity_factor=None if capacity_factor is None
                          else float(capacity_factor),
                          headroom=None if headroom is None else float(headroom))


def split_experts(placements: Any) -> tuple[Any, ExpertParallel | None]:
    """``placements`` without its expert-parallel preset (with the expert tensor-parallel
    placements it asks for instead), and that preset (None if it has none);
    ``ValueError`` for two."""
    if isinstance(placements, ExpertParallel):
        placements = [placements]
    if not isinstance(placements, (list, tuple)):
        return placements, None
    found = [p for p in placements if isinstance(p, ExpertParallel)]
    if len(found) > 1:
        raise ValueError("placements hold spmd.ep.experts() twice; pass one (its modules= "
                         "names every experts module)")
    if not found:
        return placements, None
    rest = [p for p in placements if not isinstance(p, ExpertParallel)]
    if found[0].tensor_parallel is not None:
        rest.append(ExpertTensorParallel(found[0].tensor_parallel, found[0].modules))
    return rest or None, found[0]


def expert_parameters(preset: ExpertParallel, model: nn.Module, mesh: Any, strategy: Any,
                      where: str) -> Mapping[str, str]:
    """Parameter name -> expert-parallel mesh dimension, for ``prepare_model``."""
    if strategy.context_dims and preset.capacity_factor is not None:
        raise NotImplementedError(
            f"{where}: spmd.ep.experts(capacity_factor={preset.capacity_factor}) beside "
            f"context parallelism ({', '.join(strategy.context_dims)}) is not planned yet "
            f"(each rank's part of the sequence would need its own capacity); dropless "
            f"expert parallelism composes with it")
    dim = preset.dim or strategy.shard_dim or strategy.data_dim
    if dim is None or dim not in strategy.data_dims:
        raise ValueError(f"{where}: spmd.ep.experts(dim={dim!r}): the experts are split over "
                         f"a dimension the batch is split along; the strategy's are "
                         f"{strategy.data_dims}")
    params = preset.parameters(model, mesh.size(dim), where, dim)
    return {name: dim for name in params}
