"""The options of ``parallelize``: one frozen spec, checked before anything is traced."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from spmd.runtime.compressed import FLOAT8_DTYPES as _FP8

if TYPE_CHECKING:
    from spmd.lowering.strategy import Gathered, StrategyKind

__all__ = ["Options"]
_WIRE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, *_FP8)


@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    """How ``parallelize`` plans and runs a model.

    Attributes:
        strategy: ``"ddp"``: parameters replicated, batch sharded along dim 0,
            gradients averaged. ``"fsdp"``: parameters, gradients (and so optimizer
            state) stored as dim-0 shards, gathered where used. ``"hsdp"``: ``fsdp``
            within the ``"fsdp"`` mesh dimension, replicated across ``"dp"``.
            ``"zero2"``: gradients and optimizer state as shards, parameters gathered
            once per optimizer step and kept whole; ``"zero1"``: the same with each
            gradient all-reduced whole (DeepSpeed's ZeRO stages 2 and 1).
        reshard_after_forward: (``fsdp``, ``hsdp``) free the gathered parameters after
            the forward and gather them again in backward (True, ZeRO-3), or keep the
            forward's copies for backward (False: less communication, more memory), or, as
            FSDP2's integer N, keep 1/N of each after the forward and gather it again among
            N consecutive ranks of the sharding dimension in backward (N ranks per host:
            the backward's gathers stay on the host's links). N divides the sharding
            dimension; N equal to it is True, 1 keeps the whole. With ``strategy`` it
            selects a row of ``KINDS``.
        param_dtype: (sharded strategies) the dtype parameters are gathered and computed
            in (mixed precision, e.g. ``torch.bfloat16``); floating inputs of the model
            are cast to it. The shards, their gradients and the optimizer stay in the
            parameters' own dtype. None: the parameters' dtype.
        bucket_cap_mb: the most gradient bytes (MiB) per all-reduce; None lets the cost
            model choose; 0 turns bucketing off (one all-reduce per parameter).
            Environment: ``SPMD_BUCKET_CAP_MB``.
        overlap: issue each bucket's all-reduce as soon as its gradients exist and wait
            only where the result is needed; False waits right after each issue.
        reduce_dtype: the dtype gradients travel in (e.g. ``torch.bfloat16``); results
            are accumulated back in each parameter's dtype. None keeps the parameter dtype.
        broadcast_buffers: broadcast buffers (BatchNorm statistics) from rank 0 before
            every training forward, as DistributedDataParallel does.
        compile_compute: compile the captured graphs' compute with Inductor (True), run
            them as generated Python (False), or let the planner measure both (None).
            Environment: ``SPMD_COMPILE_COMPUTE`` (0 or 1).
        calibrate: measure the collective cost model's latency and bandwidth on the live
            group when the model is parallelized (decided on rank 0, shared).
        sync_batchnorm: batch norms in training normalise by the whole batch's statistics
            (an all-reduce in the forward and one in the backward per layer, planned by
            the compiler), as ``nn.SyncBatchNorm`` does; a model holding
            ``nn.SyncBatchNorm`` layers turns it on.
        comm_hook: a communication hook with torch's DDP signature, ``hook(state,
            bucket) -> torch.futures.Future`` (``bf16_compress_hook``, ``powerSGD_hook``,
            your own): it reduces every gradient bucket, in the compiled graphs and in the
            eager safety net (``ddp`` only).
        comm_state: the hook's state (``PowerSGDState``, a process group, None).
        placements: tensor parallelism: ``{mesh dimension: {parameter name pattern:
            Shard(d) | Replicate()}}``, or a preset (``spmd.tp.megatron()``); see
            ``spmd.tp``.
        shard_placement_fn: (sharded strategies) ``fn(param) -> Shard(d) | None``, the
            dimension each parameter is sharded along (FSDP2's name and meaning), or
            ``spmd.shard_evenly``.
        pipeline: pipeline stages along a mesh dimension (``spmd.pp.schedule(...)``); the
            strategy and placements then apply to each stage on the other dimensions.
    """

    strategy: str = "ddp"
    reshard_after_forward: bool | int = True
    param_dtype: torch.dtype | None = None
    bucket_cap_mb: float | None = None
    overlap: bool = True
    reduce_dtype: torch.dtype | None = None
    broadcast_buffers: bool = True
    compile_compute: bool | None = None
    calibrate: bool = False
    placements: Any = field(default=None, compare=False)
    sync_batchnorm: bool = False
    comm_hook: Any = field(default=None, compare=False)
    comm_state: Any = field(default=None, compare=False)
    shard_placement_fn: Any = field(default=None, compare=False)
    pipeline: Any = field(default=None, compare=False)

    @classmethod
    def from_kwargs(cls, where: str, **kwargs: Any) -> "Options":
        """Options from ``parallelize``'s keywords; ``TypeError``/``ValueError`` naming the
        offending argument."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"{where}: unknown option(s) {', '.join(unknown)}; expected "
                            f"{', '.join(sorted(known))}")
        if kwargs.get("bucket_cap_mb") is None and os.environ.get("SPMD_BUCKET_CAP_MB"):
            kwargs["bucket_cap_mb"] = _env_float("SPMD_BUCKET_CAP_MB")
        if kwargs.get("compile_compute") is None and os.environ.get("SPMD_COMPILE_COMPUTE"):
            kwargs["compile_compute"] = os.environ["SPMD_COMPILE_COMPUTE"] not in ("0", "")
        options = cls(**kwargs)
        options.check(where)
        from spmd.runtime import config

        try:
            config.verify_plans()  # read while planning, inside torch.compile: checked here
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        return options

    def check(self, where: str) -> None:
        if not isinstance(self.strategy, str):
            raise TypeError(f"{where}: strategy must be a str, got {type(self.strategy).__name__}")
        from spmd.lowering.strategy import STRATEGIES

        if self.strategy not in STRATEGIES:
            raise ValueError(f"{where}: strategy {self.strategy!r} is not supported; expected one "
                             f"of {', '.join(STRATEGIES)}")
        cap = self.bucket_cap_mb
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, (int, float)):
                raise TypeError(f"{where}: bucket_cap_mb must be a number or None, got "
                                f"{type(cap).__name__}")
            if cap < 0 or cap != cap:
                raise ValueError(f"{where}: bucket_cap_mb must be >= 0 (0 turns bucketing off), "
                                 f"got {cap}")
        raf = self.reshard_after_forward
        if not isinstance(raf, int):  # (a bool is an int)
            raise TypeError(f"{where}: reshard_after_forward must be a bool or an int, got "
                            f"{type(raf).__name__}")
        if not isinstance(raf, bool) and raf < 1:
            raise ValueError(f"{where}: reshard_after_forward={raf}: an integer is the number "
                             f"of ranks the backward gathers among (FSDP2's), at least 1 and "
                             f"a divisor of the sharding dimension")
        for name in ("overlap", "broadcast_buffers", "calibrate", "sync_batchnorm"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{where}: {name} must be a bool, got "
                                f"{type(getattr(self, name)).__name__}")
        if self.compile_compute is not None and not isinstance(self.compile_compute, bool):
            raise TypeError(f"{where}: compile_compute must be a bool or None, got "
                            f"{type(self.compile_compute).__name__}")
        if self.reduce_dtype is not None:
            if not isinstance(self.reduce_dtype, torch.dtype):
                raise TypeError(f"{where}: reduce_dtype must be a torch.dtype or None, got "
                                f"{type(self.reduce_dtype).__name__}")
            if self.reduce_dtype not in _WIRE_DTYPES:
                raise ValueError(f"{where}: reduce_dtype must be a floating dtype, got "
                                 f"{self.reduce_dtype}")

        if self.reduce_dtype in _FP8 and self.sharded:
            raise ValueError(f"{where}: reduce_dtype={self.reduce_dtype} applies to 'ddp' "
                             f"(all-reduces added in float32 by spmd); sharded strategies "
                             f"reduce-scatter in the backend, which cannot add float8")
        if self.comm_hook is not None:
            from spmd.lowering.reduction import check_hook

            check_hook(self.comm_hook, where)
            if self.sharded:
                raise ValueError(f"{where}: comm_hook reduces all-reduce buckets ('ddp'); "
                                 f"strategy {self.strategy!r} reduce-scatters its gradients")
            if self.reduce_dtype is not None:
                raise ValueError(f"{where}: pass comm_hook or reduce_dtype, not both: the "
                                 f"hook decides what goes on the wire")
        elif self.comm_state is not None:
            raise ValueError(f"{where}: comm_state is given without a comm_hook")
        if self.param_dtype is not None:
            if not isinstance(self.param_dtype, torch.dtype):
                raise TypeError(f"{where}: param_dtype must be a torch.dtype or None, got "
                                f"{type(self.param_dtype).__name__}")
            if not self.param_dtype.is_floating_point:
                raise ValueError(f"{where}: param_dtype must be a floating dtype, got "
                                 f"{self.param_dtype}")
            if not self.sharded:
                raise ValueError(f"{where}: param_dtype applies to the sharded strategies "
                                 f"('fsdp', 'hsdp', 'zero1', 'zero2'), which gather "
                                 f"parameters in it; with "
                                 f"'ddp', convert the model (model.to(dtype)) instead")
        if self.shard_placement_fn is not None:
            if not callable(self.shard_placement_fn):
                raise TypeError(f"{where}: shard_placement_fn must be a callable "
                                f"fn(param) -> spmd.Shard(d) | None, got "
                                f"{type(self.shard_placement_fn).__name__}")
            if not self.sharded:
                raise ValueError(f"{where}: shard_placement_fn applies to the sharded "
                                 f"strategies; {self.strategy!r} stores whole parameters")
        if self.placements is not None:
            from spmd.lowering.strategy import tp_dims_of

            given = self.placements if isinstance(self.placements, (list, tuple)) else [
                self.placements]
            # spmd.ep.experts() names no tensor-parallel dimension: the batch's own
            experts = any(getattr(p, "expert_parallel", False) for p in given)
            if not experts and not tp_dims_of(self.placements):
                raise ValueError(f"{where}: placements names no mesh dimension")
        from spmd.lowering.strategy import KINDS, Gathered, row_argument

        argument = row_argument(raf)
        takes = [k.strategy for k in KINDS.values() if k.reshard_after_forward is argument]
        if self.strategy not in takes:
            own = KINDS[self.strategy].gathered
            raise ValueError(
                f"{where}: reshard_after_forward={raf!r} applies to the "
                f"sharded strategies that gather parameters at each use "
                f"({', '.join(map(repr, takes))}); {self.strategy!r} "
                + ("never reshards" if own is Gathered.NEVER
                   else "keeps them whole between steps"))

    @property
    def kind_name(self) -> str:
        """The row of ``KINDS`` that ``strategy`` and ``reshard_after_forward`` select."""
        from spmd.lowering.strategy import kind_name

        return kind_name(self.strategy, self.reshard_after_forward)

    @property
    def kind(self) -> StrategyKind:
        """That row."""
        from spmd.lowering.strategy import KINDS

        return KINDS[self.kind_name]

    @property
    def sharded(self) -> bool:
        """Parameters are stored as shards (fsdp, hsdp, zero1, zero2)."""
        from spmd.lowering.strategy import KINDS

        return KINDS[self.strategy].shards

    @property
    def gathered(self) -> Gathered:
        """When shards are gathered (``StrategyKind.gathered``)."""
        return self.kind.gathered

    @property
    def reshards(self) -> bool:
        """Gathered parameters are freed after the forward and gathered again in
        backward (among every rank of the sharding dimension, or N of them)."""
        from spmd.lowering.strategy import Gathered

        return self.gathered in (Gathered.EACH_USE, Gathered.REGROUPED)

    @property
    def bucket_cap_bytes(self) -> int | None:
        return None if self.bucket_cap_mb is None else int(self.bucket_cap_mb * (1 << 20))


def _env_float(name: str) -> float:
    raw = os.environ[name]
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
