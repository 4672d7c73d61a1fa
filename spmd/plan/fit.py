"""Fitting a hardware model to what was measured: to one step of any run
(:func:`fit_step`: the compute) or to a profiled run of this library (:func:`fit`: the
links and the compute). Public as ``spmd.hardware.fit`` and ``spmd.hardware.fit_step``."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from spmd.plan.hardware import COMPUTE_CLASSES, Efficiency, Hardware, Link
from spmd.plan.roofline import matmul_dtype, node_bytes, node_flops, op_class

if TYPE_CHECKING:
    from spmd.plan.plan import Plan

__all__ = ["compute_factor", "fit_step", "profile_record", "fit"]


# -- fitting a hardware model to a measured step ----------------------------------------


def compute_factor(plan: Plan, step_seconds: float, *, optimizer: str | None = "adamw",
                   clip_grad_norm: bool = False) -> float:
    """How many times the roofline's compute must stretch for ``plan``'s predicted step
    to take ``step_seconds`` (bisection: the step grows with it; the collectives keep
    their times)."""
    where = "spmd.hardware.fit_step"
    if plan.mesh is None or plan.mesh.hardware is None or not plan.compute:
        raise ValueError(f"{where}: the plan has no hardware model to fit (plan with "
                         f"mesh=spmd.Mesh.simulated(..., hardware=...))")
    if not step_seconds > 0:
        raise ValueError(f"{where}: step_seconds must be positive, got {step_seconds!r}")

    def step(factor: float) -> float:
        return plan.predicted_timeline(optimizer, clip_grad_norm, factor).step_seconds

    low, high = 1 / 64, 64.0
    if step(low) > step_seconds:
        raise ValueError(f"{where}: even with compute 64x faster the plan predicts "
                         f"{step(low):.4g} s (its communication alone), more than the "
                         f"measured {step_seconds:.4g} s: the links, not the device, are off")
    if step(high) < step_seconds:
        raise ValueError(f"{where}: the measured {step_seconds:.4g} s is over 64x the "
                         f"predicted {step(1.0):.4g} s: is it the same model, batch and "
                         f"mesh?")
    for _ in range(60):
        mid = (low * high) ** 0.5
        low, high = (mid, high) if step(mid) < step_seconds else (low, mid)
    return (low * high) ** 0.5


def fit_step(plan: Plan, step_seconds: float, *, optimizer: str | None = "adamw",
             clip_grad_norm: bool = False) -> Hardware:
    """The plan's hardware with its compute efficiencies fitted to one measured step.

    For a run you know only by its throughput (a published table, another framework's
    log): plan the same model, batch and mesh, and give the measured seconds of one step
    (``tokens per step / tokens/s``). Every compute class (matrix products, attention,
    memory-bound, the optimizer's pass) is slowed by one factor until the predicted step
    (with ``optimizer`` and ``clip_grad_norm`` as in :meth:`Plan.predicted_timeline`)
    takes ``step_seconds``; each efficiency then says so in its source. Plans made with
    the result for other shapes and meshes of the same cluster carry that calibration
    (``benchmarks/published.py`` holds such predictions against runs the fit never saw).
    An efficiency the factor would lift past 1 stays at 1.

    Example::

        plan = spmd.inspect(model, tokens, mesh=spmd.Mesh.simulated(64, hardware=H100_SXM()))
        fitted = spmd.hardware.fit_step(plan, step_seconds=1.155)
    """
    factor = compute_factor(plan, step_seconds, optimizer=optimizer,
                            clip_grad_norm=clip_grad_norm)
    hardware = plan.mesh.hardware
    device = hardware.device
    why = (f"fitted to a measured step of {step_seconds:.4g} s ({factor:.3f}x the "
           f"roofline's compute)")
    efficiencies = dict(device.efficiencies)
    for kind in COMPUTE_CLASSES:  # the classes given by dtype, and the class itself
        keys = [k for k in device.efficiencies if k == kind or k.startswith(kind + ".")]
        for key in keys or [kind]:
            old = device.efficiencies.get(key) or device.efficiency_of(kind)
            efficiencies[key] = Efficiency(value=min(1.0, old.value / factor),
                                           source=f"{why}; was {old.value:.1%}: {old.source}")
    fitted = replace(device, efficiencies=efficiencies,
                     efficiency=min(1.0, device.efficiency / factor),
                     source=f"{device.source}; compute {why}")
    return replace(hardware, name=f"{hardware.name}, {why}", device=fitted)


# -- fitting a hardware model from a profiled run ---------------------------------------

# (α coefficient, β coefficient) of each collective's time, as the cost model's formulas
# give them for p ranks and n bytes
_TERMS = {
    "all_reduce": lambda p, n: (2 * (p - 1), 2 * (p - 1) / p * n),
    "all_gather": lambda p, n: (p - 1, (p - 1) / p * n),
    "reduce_scatter": lambda p, n: (p - 1, (p - 1) / p * n),
    "all_to_all": lambda p, n: (p - 1, (p - 1) / p * n),
}


def profile_record(plan: Plan) -> dict:
    """What :func:`fit` needs from a profiled plan (``spmd.profile``, then
    ``spmd.inspect``): each collective's kind, bytes, ranks and measured seconds (median
    over the profiled steps), and each graph's measured compute with its nodes' FLOPs
    and bytes. JSON-ready; ``plan.save_profile(path)`` writes it."""
    import statistics

    timelines = list(getattr(plan, "measured_steps", None) or
                     ([plan.measured] if plan.measured is not None else []))
    if not timelines:
        raise ValueError("save_profile: the plan has no measured step; run spmd.profile("
                         "model, steps=N) and N training steps first")
    measured: dict[tuple[str, str], list[float]] = {}
    for timeline in timelines:
        for span in timeline.spans:
            measured.setdefault((span.lane, span.label), []).append(span.seconds)
    collectives = []
    for c in plan.collectives:
        seconds = measured.get(("communication", c.name))
        if seconds:
            collectives.append({"name": c.name, "kind": c.kind, "bytes": c.bytes,
                                "ranks": plan.mesh.size(c.mesh_dim) if c.mesh_dim else
                                plan.world_size, "mesh_dim": c.mesh_dim,
                                "seconds": statistics.median(seconds)})
    compute = []
    for key, gm in plan.graphs.items():
        region, phase = key.rsplit(".", 1)
        seconds = measured.get(("compute", f"{region} {phase}"))
        if not seconds:
            continue
        nodes = []
        for node in gm.graph.nodes:
            kind = op_class(node)
            if kind == "free":
                continue
            dtype = str(matmul_dtype(node, None)).removeprefix("torch.")
            nodes.append([node_flops(node), node_bytes(node), dtype, kind])
        compute.append({"graph": key, "seconds": statistics.median(seconds), "nodes": nodes})
    return {"format": "spmd-profile-1", "mesh": {"shape": list(plan.mesh.shape),
                                                 "dim_names": list(plan.mesh.dim_names)},
            "backend": plan.cost_model.backend, "collectives": collectives,
            "compute": compute}


def fit(profile: Any, base: Hardware, *, link: str | None = None) -> Hardware:
    """``base`` with the link the profiled collectives ran on, and the device's
    efficiency, fitted to a profiled run of this library.

    Args:
        profile: a path to what ``plan.save_profile(path)`` wrote, or that dict.
        base: the hardware the run was on (its datasheet figures: peak FLOP/s, memory
            bandwidth, the other link).
        link: ``"intra"`` or ``"inter"``; by default ``"intra"`` when the profiled groups
            fit in one of ``base``'s nodes.

    The link's latency α and seconds per byte β are the least-squares fit of every
    measured collective's time to the cost model's formula for its kind (at least two
    sizes are needed); the efficiency is the graphs' roofline at full efficiency over
    their measured compute time.
    """
    import json

    import numpy as np

    where = "spmd.hardware.fit"
    if not isinstance(base, Hardware):
        raise TypeError(f"{where}: base must be a Hardware (the datasheet to start from), got "
                        f"{type(base).__name__}")
    name = "a profile"
    if isinstance(profile, (str, bytes)) or hasattr(profile, "__fspath__"):
        name = str(profile)
        with open(profile) as f:
            profile = json.load(f)
    if not isinstance(profile, dict) or profile.get("format") != "spmd-profile-1":
        raise ValueError(f"{where}: {name} is not a profile written by plan.save_profile()")
    samples = [c for c in profile["collectives"] if c["kind"] in _TERMS and c["ranks"] > 1]
    if len({c["bytes"] for c in samples}) < 2:
        raise ValueError(f"{where}: {name} holds collectives of {len({c['bytes'] for c in samples})} "
                         f"size(s); fitting latency and bandwidth needs at least two (profile "
                         f"with bucket_cap_mb=0, or a model with buckets of different sizes)")
    rows = [_TERMS[c["kind"]](c["ranks"], c["bytes"]) for c in samples]
    times = [c["seconds"] for c in samples]
    (alpha, beta), *_ = np.linalg.lstsq(np.array(rows, dtype=float), np.array(times),
                                        rcond=None)
    if not float(beta) > 0:
        largest = max(c["bytes"] for c in samples)
        raise ValueError(f"{where}: the collectives in {name} do not determine a bandwidth "
                         f"(the fit gives {float(beta):.3g} s/B: their times are latency and "
                         f"noise; the largest is {largest:,} bytes). Profile larger buckets, "
                         f"megabytes at least")
    alpha, beta = max(float(alpha), 0.0), float(beta)
    ranks = max(c["ranks"] for c in samples)
    which = link or ("intra" if ranks <= base.ranks_per_node else "inter")
    if which not in ("intra", "inter"):
        raise ValueError(f"{where}: link must be 'intra' or 'inter', got {link!r}")
    fitted = Link(name=getattr(base, which).name, bandwidth=1.0 / beta, latency=alpha,
                  source=f"fitted from {name}: {len(samples)} collectives over {ranks} ranks "
                         f"({profile.get('backend', '?')})")
    roofline = measured = 0.0
    for graph in profile["compute"]:
        for flops, nbytes, dtype, *_ in graph["nodes"]:
            peak = base.device.peak(getattr(torch, dtype, torch.float32))
            roofline += max(flops / peak, nbytes / base.device.memory_bandwidth)
        measured += graph["seconds"]
    device = base.device
    if measured > 0 and roofline > 0:
        value = min(1.0, roofline / measured)
        fitted_eff = Efficiency(value=value, source=f"fitted from {name}: the graphs' "
                                f"roofline at peak over their measured compute, one factor "
                                f"for every compute class")
        efficiencies = {k: e for k, e in device.efficiencies.items()
                        if k.startswith("collective")}
        efficiencies.update({k: fitted_eff for k in ("matmul", "attention", "memory")})
        device = replace(device, efficiency=value, efficiencies=efficiencies,
                         source=f"{device.source}; efficiency fitted from {name}")
    return replace(base, name=f"{base.name}, fitted from {name}", device=device,
                   **{which: fitted})
