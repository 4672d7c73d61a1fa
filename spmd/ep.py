"""Expert parallelism: the experts of each mixture-of-experts layer split by expert index
over the ranks of a data dimension, tokens sent to them and back by all-to-all.

    mesh = spmd.Mesh((4,), dim_names=("ep",))
    model = spmd.parallelize(MoE(), mesh=mesh, placements=spmd.ep.experts())
    model = spmd.parallelize(MoE(), mesh=mesh, strategy="fsdp",
                             placements=spmd.ep.experts())

The expert-parallel dimension is a data dimension, as torchtitan borrows it from the data
ranks: every rank gets its own batch, and everything but the experts (attention, the
router, shared experts, norms) runs on it as the strategy says (``ddp``: replicated,
``fsdp``: sharded and gathered), its gradients averaged over the ranks. The experts'
weights are stored by expert index (rank ``r`` holds ``E / n`` of them, never gathered)
and each rank's routing is the model's own code (softmax or sigmoid scores, top-k,
normalised weights, DeepSeek's grouped and bias-corrected top-k): only the experts
module's forward is replaced. It sends each (token, choice) row to the rank holding its
expert (``spmd::ep_route``, ``spmd::ep_scatter``: the counts exchanged, then an
all-to-all with uneven splits), multiplies each expert's rows by its weights
(``spmd::grouped_mm``), applies the module's own gate and activation, and sends the rows
back (``spmd::ep_gather``), where the routing weights combine them as the model did.
Dropless: every token reaches its experts however uneven the routing (an expert with no
token, every token on one rank). See :mod:`spmd.lowering.experts` for the ops and
``docs/experts.md`` for the whole picture.

An experts module is what transformers' ``use_experts_implementation`` makes (Mixtral,
Qwen2/3-MoE, DeepSeek-V3, OLMoE, GPT-OSS, ...) or anything shaped like it: stacked
``gate_up_proj`` ``(E, 2I, H)`` (or ``up_proj`` without a gate) and ``down_proj``
``(E, H, I)``, optional ``*_bias`` ``(E, out)``, ``is_transposed`` for ``(E, in, out)``
weights, ``act_fn`` or ``_apply_gate``, and ``forward(hidden (T, H), top_k_index (T, k),
top_k_weights (T, k))``.
"""

from __future__ import annotations

import fnmatch
import inspect
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["experts", "ExpertParallel", "ExpertTensorParallel", "find_experts", "expert_load",
           "dropped_tokens", "split_experts", "load_balancing_loss"]


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
    ones whose paths match ``patterns``."""
    found = {}
    for path, module in model.named_modules():
        if patterns and not any(fnmatch.fnmatchcase(path, p) for p in patterns):
            continue
        if _weights(module) and _routed(module):
            found[path] = module
    return found


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
            tensor_parallel: str | None = None, capacity_factor: float | None = None
            ) -> ExpertParallel:
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
    return ExpertParallel(dim=dim, modules=tuple(modules), tensor_parallel=tensor_parallel,
                          capacity_factor=None if capacity_factor is None
                          else float(capacity_factor))


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


def expert_load(model: nn.Module) -> dict[str, torch.Tensor]:
    """The last forward's token count per expert of each expert-parallel layer (module
    path -> ``(E,)`` counts over every rank), gathered over the expert-parallel group:
    every rank must call it."""
    from spmd.lowering.specs import lookup
    from spmd.runtime.collectives import all_gather_into_tensor

    out: dict[str, torch.Tensor] = {}
    for path, module in model.named_modules():
        handle = getattr(module, "_spmd_ep_handle", None)
        if handle is None:
            continue
        spec = lookup(handle)
        if spec.load is None:
            continue
        whole = spec.load.new_zeros(spec.num_experts)
        if spec.communicates:
            all_gather_into_tensor(whole, spec.load.contiguous(), group=spec.group)
        else:
            whole.copy_(spec.load.repeat(spec.size))
        out[path] = whole
    return out


def dropped_tokens(model: nn.Module) -> dict[str, torch.Tensor]:
    """Under a capacity factor (:func:`experts`), the (token, choice) pairs the last
    forward dropped per expert of each expert-parallel layer (module path -> ``(E,)``
    counts summed over the expert-parallel group; zeros when dropless or nothing was
    dropped); every rank must call it."""
    from spmd.lowering.specs import lookup
    from spmd.runtime.collectives import all_reduce

    out: dict[str, torch.Tensor] = {}
    for path, module in model.named_modules():
        handle = getattr(module, "_spmd_ep_handle", None)
        if handle is None:
            continue
        spec = lookup(handle)
        if spec.load is None:
            continue
        total = (spec.dropped.clone() if spec.dropped is not None
                 else spec.load.new_zeros(spec.num_experts))
        if spec.communicates:
            all_reduce(total, group=spec.group)
        out[path] = total
    return out


# -- the forward that replaces the experts module's --------------------------------------


@dataclass(frozen=True)
class _Reads:
    """How the experts forward reads each stacked weight: as stored (this rank's
    experts), or, split by tensor parallelism too (``spmd.ep.experts`` beside a ``tp``
    dimension), through ``spmd::tp_param`` (its handle here), which the compiler keeps
    as this rank's piece and the eager path gathers along the tensor-parallel
    dimensions."""

    pieces: tuple[tuple[str, int], ...] = ()

    def __call__(self, module: nn.Module, name: str) -> torch.Tensor | None:
        if name not in module._parameters:  # (no getattr with a default: Dynamo guards
            return None                     # it with hasattr, which would gather it)
        value = getattr(module, name)
        for known, handle in self.pieces:
            if known == name:
                from spmd.lowering.ops import tp_param

                return tp_param(value, handle)
        return value


class _Placed(NamedTuple):
    """What the experts forward reads of its layer: plain numbers and names, found when
    it was placed (Dynamo traces no spec lookup)."""

    handle: int
    size: int
    experts: int
    up: str
    down: str
    read: _Reads
    capacity_factor: float | None


def _ep_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    from spmd.lowering import experts as ops

    handle, size, experts, up, down, read, capacity_factor = self._spmd_ep
    tokens, k = top_k_index.shape
    hidden = hidden_states.shape[-1]
    transposed = bool(getattr(self, "is_transposed", False))
    scale = 1.0 / size
    order, send, recv, offs = ops.ep_route(top_k_index.to(torch.int64), handle)
    rows = hidden_states.repeat_interleave(k, dim=0)
    bound = ops.bound_rows(size, tokens, k, experts // size, capacity_factor, experts)
    # the rows even routing brings (a plan prices the products on them, not the bound)
    cap = ops.capacity(capacity_factor, tokens, k, experts)
    expected = tokens * k if cap is None else min(tokens * k, experts * cap)
    xs = ops.ep_scatter(rows, order, send, recv, bound, handle)
    h = ops.grouped_mm(xs, read(self, up), offs, read(self, f"{up}_bias"), transposed, scale,
                       expected)
    if up == "gate_up_proj":
        h = self._apply_gate(h) if hasattr(self, "_apply_gate") else _gate(self, h)
    else:
        h = self.act_fn(h)
    ys = ops.grouped_mm(h, read(self, down), offs, read(self, f"{down}_bias"), transposed,
                        scale, expected)
    if getattr(self, "has_post_expert_norm", False):
        ys = self.post_expert_norm(ys)
    back = ops.ep_gather(ys, order, send, recv, handle)
    out = (back.view(tokens, k, hidden) * top_k_weights.unsqueeze(-1).to(back.dtype)).sum(1)
    return out.to(hidden_states.dtype)


def _gate(self: nn.Module, h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return self.act_fn(gate) * up


_CLASSES: dict[type, type] = {}


def _ep_class(cls: type) -> type:
    sub = _CLASSES.get(cls)
    if sub is None:
        sub = type(f"ExpertParallel{cls.__name__}", (cls,),
                   {"forward": _ep_forward, "__module__": cls.__module__})
        _CLASSES[cls] = sub
    return sub


def place_experts(module: nn.Module, strategy: Any, handles: Any,
                  preset: ExpertParallel | None = None) -> dict[str, Any]:
    """Give every experts module of ``module`` that ``strategy.experts`` names the
    expert-parallel forward (its class swapped) and a spec (the ``preset``'s capacity
    factor); the specs by module path."""
    mesh = strategy.mesh
    specs: dict[str, Any] = {}
    paths = {name.rpartition(".")[0]: dim for name, dim in strategy.experts.items()}
    for path, dim in sorted(paths.items()):
        sub = module.get_submodule(path) if path else module
        if not _routed(sub):  # a pipeline stage's: placed on the whole model, and traced
            continue
        count = _whole(sub, _weights(sub)[0])[0]
        specs[path] = _place(sub, path, count, mesh, dim, handles,
                             _Reads(_tp_pieces(sub, path, strategy, handles)), preset)
    return specs


def _whole(module: nn.Module, name: str) -> tuple[int, ...]:
    """The whole shape of a placed parameter (from its record, without reading it: a
    sharded one would be gathered)."""
    param = module._parameters[name]
    return tuple(param._spmd_placement.shape)


def _place(sub: nn.Module, path: str, count: int, mesh: Any, dim: str, handles: Any,
           read: _Reads, preset: ExpertParallel | None) -> Any:
    """One experts module given the expert-parallel forward (its class swapped) and the
    spec of its ``count`` experts over ``dim``."""
    from spmd.lowering.experts import ExpertsSpec

    size = mesh.size(dim)
    factor = preset.capacity_factor if preset is not None else None
    spec = ExpertsSpec(module=path, num_experts=count, size=size,
                       group=None if mesh.simulated else mesh.get_group(dim), mesh_dim=dim,
                       capacity_factor=factor)
    names = _weights(sub)
    sub._spmd_ep_handle = handles.add(spec)
    sub._spmd_ep = _Placed(sub._spmd_ep_handle, size, count, names[0], names[1], read, factor)
    sub.__class__ = _ep_class(type(sub))
    return spec


def _tp_pieces(module: nn.Module, path: str, strategy: Any, handles: Any
               ) -> tuple[tuple[str, int], ...]:
    """(weight name, handle of its ``TPSpec``) for each stacked weight of ``module`` that
    a tensor-parallel dimension splits as well: the spec cuts this rank's experts (whole
    along the tensor-parallel dimensions) into its piece there."""
    from spmd.lowering.placements import divides
    from spmd.lowering.specs import TPSpec

    mesh = strategy.mesh
    found = []
    for local in _weights(module):
        name = f"{path}.{local}" if path else local
        placed = strategy.tp_placement(name)
        if not any(divides(p) for p in placed.values()):
            continue
        shape = list(_whole(module, local))  # this rank's experts, whole on "tp"
        shape[0] //= mesh.size(strategy.experts[name])
        spec = TPSpec(param=name, shape=tuple(shape), sharding=strategy.parameter_sharding(name),
                      dims=strategy.tp_dims,
                      groups={d: None if mesh.simulated else mesh.get_group(d)
                              for d in strategy.tp_dims})
        found.append((local, handles.add(spec)))
    return tuple(found)


def place_for_pipeline(preset: ExpertParallel, model: nn.Module, mesh: Any, handles: Any,
                       where: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``pipeline=`` with expert parallelism: the whole model's experts modules given the
    expert-parallel forward before it is traced (each stage's graph then holds the
    expert ops), their specs over dimension ``preset.dim`` of the stage mesh ``mesh``.
    Each expert parameter's name -> (that dimension, its shape on this rank, which the
    trace reads: the stages store only their experts)."""
    if preset.tensor_parallel is not None:
        raise NotImplementedError(
            f"{where}: expert tensor parallelism in a pipeline is not planned yet (each "
            f"stage's experts would need their pieces read in the traced graph); pass "
            f"spmd.ep.experts() without tensor_parallel=")
    dims = () if mesh is None else mesh.dim_names
    dim = preset.dim or (dims[0] if len(dims) == 1 else None)
    if dim is None or dim not in dims:
        raise ValueError(
            f"{where}: spmd.ep.experts(dim={preset.dim!r}) in a pipeline: the experts are "
            f"split over a dimension of the stages' mesh (besides the pipeline's: "
            f"{dims}); name it with dim=")
    size = mesh.size(dim)
    params = preset.parameters(model, size, where, dim)
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in sorted(set(params.values())):
        sub = model.get_submodule(path) if path else model
        names = _weights(sub)
        count = getattr(sub, names[0]).shape[0]  # whole until a stage stores its own
        _place(sub, path, count, mesh, dim, handles, _Reads(), preset)
        for local in names:
            shape = list(getattr(sub, local).shape)
            shape[0] //= size
            out[f"{path}.{local}" if path else local] = (dim, tuple(shape))
    return out


def expert_parameters(preset: ExpertParallel, model: nn.Module, mesh: Any, strategy: Any,
                      where: str) -> Mapping[str, str]:
    """Parameter name -> expert-parallel mesh dimension, for ``prepare_model``."""
    if strategy.context_dims:
        raise NotImplementedError(
            f"{where}: spmd.ep.experts() beside context parallelism "
            f"({', '.join(strategy.context_dims)}) is not planned yet (each rank's part of "
            f"the sequence would be gathered to route it); expert parallelism composes with "
            f"the data strategies, tensor and sequence parallelism and pipelines")
    dim = preset.dim or strategy.shard_dim or strategy.data_dim
    if dim is None or dim not in strategy.data_dims:
        raise ValueError(f"{where}: spmd.ep.experts(dim={dim!r}): the experts are split over "
                         f"a dimension the batch is split along; the strategy's are "
                         f"{strategy.data_dims}")
    params = preset.parameters(model, mesh.size(dim), where, dim)
    return {name: dim for name in params}


# -- the plan's lines -----------------------------------------------------------------


def all_to_all_seconds(plan: Any) -> dict[str, dict[str, tuple[str, float]]]:
    """Each graph's expert ops that move data between ranks, priced for even routing by
    the cost model along their dimension (on a simulated cluster, per link: what
    crosses nodes on the network, the rest on NVLink at once): graph key -> {node name:
    (layer, seconds)}. ``ep_route`` exchanges the counts (``E`` int64s); ``ep_scatter``
    sends its input's rows, ``ep_gather`` returns its output's (each rank's pairs)."""
    from spmd.lowering import experts as ops
    from spmd.lowering.cost_model import along
    from spmd.lowering.propagate import module_of
    from spmd.lowering.specs import lookup

    out: dict[str, dict[str, tuple[str, float]]] = {}
    models: dict[str, Any] = {}
    for key, graph in plan.graphs.items():
        for node in graph.graph.nodes:
            if node.target not in (ops.ep_route, ops.ep_scatter, ops.ep_gather):
                continue
            try:
                spec = lookup(node.args[-1])
            except RuntimeError:  # a plan that outlived its model
                continue
            if spec.size <= 1:
                continue
            if node.target is ops.ep_route:
                nbytes = spec.num_experts * 8
            else:
                val = (node.args[0] if node.target is ops.ep_scatter else node).meta.get("val")
                nbytes = int(val.numel()) * val.element_size() if val is not None else 0
            model = models.get(spec.mesh_dim)
            if model is None:
                model = models[spec.mesh_dim] = along(plan.mesh, spec.mesh_dim,
                                                      plan.cost_model)
            out.setdefault(key, {})[node.name] = (
                spec.module or module_of(node), model.seconds("all_to_all", nbytes))
    return out


def plan_lines(plan: Any) -> list[str]:
    """The plan's section on expert parallelism: each layer's experts per rank, the rows
    it sends per step and its all-to-alls priced by the plan's cost model for even
    routing (:func:`all_to_all_seconds`: the counts' exchange, then rows out and back in
    forward, and again in backward); [] for a model without it."""
    from spmd.lowering import experts as ops
    from spmd.lowering.propagate import module_of
    from spmd.lowering.specs import lookup

    layers: dict[str, tuple[Any, int, int]] = {}
    for name, graph in plan.graphs.items():
        if not name.endswith(".forward"):
            continue
        for node in graph.graph.nodes:
            if node.target is not ops.ep_scatter:
                continue
            val = node.args[0].meta.get("val")
            try:
                spec = lookup(node.args[-1])
            except RuntimeError:
                continue
            nbytes = int(val.numel()) * val.element_size() if val is not None else 0
            layers[spec.module or module_of(node)] = (spec, int(val.shape[0]), nbytes)
    if not layers:
        return []
    seconds: dict[str, float] = {}
    for nodes in all_to_all_seconds(plan).values():
        for layer, t in nodes.values():
            seconds[layer] = seconds.get(layer, 0.0) + t
    first = next(iter(layers.values()))[0]
    kept = ("dropless" if first.capacity_factor is None else
            f"capacity factor {first.capacity_factor:g} (each expert at most "
            f"ceil({first.capacity_factor:g}·T·k/E) of each rank's pairs, the rest dropped)")
    where = (f" on {plan.mesh.hardware.name}, per link" if plan.mesh is not None
             and plan.mesh.hardware is not None else "")
    lines = ["", f"expert parallelism along {first.mesh_dim!r} ({first.size} ranks), {kept}; "
                 f"all-to-alls priced for even routing{where}:",
             f"{'layer':<36} {'experts':>7} {'per rank':>8} {'rows out':>8} "
             f"{'bytes out':>10} {'pred µs/step':>12}"]
    total = 0.0
    for path, (spec, rows, nbytes) in sorted(layers.items()):
        total += seconds.get(path, 0.0)
        lines.append(f"{path:<36} {spec.num_experts:>7} {spec.local:>8} {rows:>8} "
                     f"{nbytes:>10,} {seconds.get(path, 0.0) * 1e6:>12.1f}")
    lines.append(f"expert all-to-alls per step: {total * 1e3:.3f} ms predicted, blocking "
                 f"(spmd.ep.expert_load(model): each expert's tokens in the last forward)")
    return lines


# -- the router's auxiliary loss over every data rank's tokens --------------------------


def load_balancing_loss(router_logits: Any, top_k: int, model: nn.Module | None = None,
                        num_experts: int | None = None) -> torch.Tensor:
    """The Switch Transformer / Mixtral load-balancing loss (transformers'
    ``load_balancing_loss_func``, without a padding mask) over the tokens of every data
    rank of ``model``, as one process computes it on the whole batch.

    ``E · Σ_e f_e · P_e`` (``f_e``: the share of choices routed to expert ``e``, per
    choice slot; ``P_e``: the mean router probability of ``e``) is a product of two means
    over tokens, not a mean over tokens: computed on each rank's rows and averaged (what
    ddp does to a loss) it is not the whole batch's. Here both means are averaged over
    the data ranks first (``spmd::data_mean``: an all-reduce forward, each rank's
    gradient passed on unscaled, so that ddp's average gives the whole batch's).
    Every rank must call it with the same number of tokens. A z-loss (the mean of
    ``logsumexp(logits)²``) is a mean over tokens, exact without this.

    Args:
        router_logits: ``(tokens, experts)`` logits, or a sequence of them (one per
            layer, as transformers returns ``router_logits``): concatenated, as
            transformers does.
        top_k: choices per token.
        model: the parallelized model whose data ranks hold the batch (None, or a model
            not parallelized: this process's tokens alone).
        num_experts: defaults to the logits' last dimension.
    """
    from spmd.lowering.experts import data_mean

    logits = (torch.cat([torch.as_tensor(t) for t in router_logits], dim=0)
              if isinstance(router_logits, (list, tuple)) else router_logits)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"spmd.ep.load_balancing_loss: router_logits must be (tokens, "
                         f"experts) logits or a sequence of them, got "
                         f"{getattr(logits, 'shape', type(logits).__name__)}")
    experts = num_experts or logits.shape[-1]
    if not isinstance(top_k, int) or not 0 < top_k <= experts:
        raise ValueError(f"spmd.ep.load_balancing_loss: top_k must be in 1..{experts}, "
                         f"got {top_k!r}")
    probs = logits.softmax(dim=-1)
    _, selected = probs.topk(top_k, dim=-1)
    mask = F.one_hot(selected, experts).to(probs.dtype)
    tokens_per_expert = mask.mean(dim=0)          # (k, E)
    router_prob = probs.mean(dim=0)               # (E,)
    handle = _mean_handle(model)
    if handle is not None:
        tokens_per_expert = data_mean(tokens_per_expert, handle)
        router_prob = data_mean(router_prob, handle)
    return (tokens_per_expert * router_prob.unsqueeze(0)).sum() * experts


def _mean_handle(model: nn.Module | None) -> int | None:
    """The handle of a :class:`~spmd.lowering.experts.MeanSpec` over ``model``'s data
    ranks (made once per model); None for no model or one not parallelized."""
    from spmd.lowering.experts import MeanSpec

    program = getattr(model, "_spmd", None) if model is not None else None
    if program is None:
        return None
    handle = getattr(program, "_spmd_mean_handle", None)
    if handle is None:
        setup = program.setup
        spec = MeanSpec(group=setup.group, size=setup.world_size)
        handle = program.handles.add(spec)
        program._spmd_mean_handle = handle
    return handle
