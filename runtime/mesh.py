"""Mesh: ranks arranged in an n-dimensional grid with named dimensions.

``Mesh(shape=(2, 4), dim_names=("dp", "tp"))`` lays the world's ranks out row-major;
rank 5 sits at coordinate (1, 1). Along each dimension, the ranks that differ only in
that coordinate form a slice with its own process group, so ``mesh.get_group("tp")``
is the group this rank all-reduces with for tensor parallelism. ``Mesh.simulated``
describes a mesh of any size without processes, for planning.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

from spmd.runtime.groups import new_group, world
from spmd.runtime.process_group import ProcessGroup
from spmd.runtime.topology import Topology, get_topology

__all__ = ["Mesh"]


def _shape(shape: object) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, int) else shape
    if isinstance(dims, (str, bytes)) or not hasattr(dims, "__iter__"):
        raise TypeError(f"Mesh shape must be an int or a tuple of ints, got {shape!r}")
    out = tuple(dims)  # type: ignore[arg-type]
    if not out:
        raise ValueError("Mesh shape must have at least one dimension")
    for d in out:
        if not isinstance(d, int) or isinstance(d, bool) or d < 1:
            raise ValueError(f"Mesh shape must be positive ints, got {shape!r}")
    return out


def _flat_index(coord: Sequence[int], extents: Sequence[int]) -> int:
    """The row-major position of ``coord`` in a grid of ``extents``."""
    index = 0
    for c, extent in zip(coord, extents):
        index = index * extent + c
    return index


def _names(names: object, ndim: int) -> tuple[str, ...]:
    if names is None:
        return ("dp",) if ndim == 1 else tuple(f"dim{i}" for i in range(ndim))
    if isinstance(names, str):
        names = (names,)
    out = tuple(names)  # type: ignore[arg-type]
    if len(out) != ndim:
        raise ValueError(f"Mesh dim_names has {len(out)} names for {ndim} dimensions: {out}")
    if any(not isinstance(n, str) or not n for n in out):
        raise TypeError(f"Mesh dim_names must be non-empty strings, got {out}")
    if len(set(out)) != len(out):
        raise ValueError(f"Mesh dim_names must be unique, got {out}")
    return out


class Mesh:
    """An n-dimensional arrangement of global ranks with named dimensions.

    Args:
        shape: the grid, e.g. ``8`` or ``(2, 4)``; its product is the number of ranks.
        dim_names: one name per dimension (default ``("dp",)`` for one dimension).
        ranks: the global ranks laid out row-major (default: the whole world, which must
            then have exactly ``prod(shape)`` ranks). Every rank of the world calls
            ``Mesh(...)`` in the same order, as with ``new_group``.

    Example::

        mesh = Mesh(shape=(2, 2), dim_names=("dp", "tp"))
        mesh.coordinate()             # (1, 0) on rank 2
        dist.all_reduce(t, group=mesh.get_group("tp"))
    """

    def __init__(self, shape: int | Sequence[int], dim_names: Sequence[str] | None = None,
                 ranks: Sequence[int] | None = None, *, _simulated: bool = False) -> None:
        self.shape = _shape(shape)
        self.dim_names = _names(dim_names, len(self.shape))
        self.simulated = _simulated
        self.hardware: Any = None  # what a simulated mesh plans for (spmd.hardware)
        # a simulated mesh's hosts and the link between them (Mesh.simulated's topology=
        # and network=): plan a job across hosts of this library's runtime before it runs
        self._topology: Topology | None = None
        self.network: Any = None
        total = math.prod(self.shape)
        self._groups: dict[int, ProcessGroup] = {}
        self._coordinate: tuple[int, ...] | None = None
        if _simulated:
            self.ranks = list(range(total))
            return
        state = world("Mesh")
        if ranks is None:
            if total != state.size:
                raise ValueError(f"Mesh shape {self.shape} holds {total} ranks but the world has "
                                 f"{state.size}; pass ranks= to use a subset")
            self.ranks = list(range(total))
        else:
            self.ranks = [int(r) for r in ranks]
            if len(self.ranks) != total:
                raise ValueError(f"Mesh shape {self.shape} holds {total} ranks, got "
                                 f"{len(self.ranks)} in ranks")
            if len(set(self.ranks)) != total or any(not 0 <= r < state.size for r in self.ranks):
                raise ValueError(f"Mesh ranks must be distinct ranks of the world "
                                 f"[0, {state.size}), got {self.ranks}")
        state.meshes += 1
        tag = f"mesh{state.meshes}"
        if state.rank in self.ranks:
            self._coordinate = self.coordinate_of(state.rank)
            for dim, name in enumerate(self.dim_names):
                members = self._slice(self._coordinate, dim)
                index = self._slice_index(self._coordinate, dim)
                self._groups[dim] = new_group(members, group_name=f"{tag}/{name}/{index}")

    @classmethod
    def from_group(cls, group: ProcessGroup, dim_name: str = "dp") -> "Mesh":
        """A 1-D mesh over an existing process group (``DeviceMesh.from_group`` in torch):
        no new group is made, so only this rank needs to call it."""
        from spmd.runtime.groups import as_ours

        group = as_ours(group, "Mesh.from_group")
        group.require("Mesh.from_group")
        mesh = cls.__new__(cls)
        mesh.shape = (group.size(),)
        mesh.dim_names = _names(dim_name, 1)
        mesh.simulated = False
        mesh.hardware = None
        mesh._topology, mesh.network = None, None
        mesh.ranks = list(group.ranks)
        mesh._groups = {0: group}
        mesh._coordinate = (group.rank(),)
        return mesh

    @classmethod
    def simulated(cls, shape: int | Sequence[int], dim_names: Sequence[str] | None = None,
                  hardware: Any = None, *, topology: Topology | None = None,
                  network: Any = None) -> "Mesh":
        """A mesh of any size that exists only on paper: no processes, no operations.

        ``hardware`` (an ``spmd.hardware.Hardware``, e.g. ``H100_SXM(nodes_of=8)``): plan
        for that cluster (collective costs per dimension from its links, compute from the
        graphs' FLOPs on its device, memory against its capacity) instead of this
        machine. ``topology`` (a :class:`Topology` over the mesh's ranks) and ``network``
        (an ``spmd.lowering.cost_model.NetworkLink``): plan for this library's runtime on
        hosts joined by that link (what a live job across hosts probes at start-up), each
        dimension priced on the link it crosses."""
        mesh = cls(shape, dim_names, _simulated=True)
        if (topology is None) != (network is None):
            raise ValueError("Mesh.simulated: pass topology= and network= together (where the "
                             "ranks are, and the link between their hosts)")
        if topology is not None:
            if hardware is not None:
                raise ValueError("Mesh.simulated: hardware= already says where ranks are; pass "
                                 "it or topology=/network=, not both")
            if not isinstance(topology, Topology) or topology.world_size != len(mesh.ranks):
                raise ValueError(f"Mesh.simulated: topology must be a Topology of "
                                 f"{len(mesh.ranks)} ranks, got {topology!r}")
            mesh._topology, mesh.network = topology, network
        if hardware is not None and not all(
                hasattr(hardware, a) for a in ("device", "intra", "inter", "cost_model")):
            raise TypeError(f"Mesh.simulated: hardware must be an spmd.hardware.Hardware, got "
                            f"{type(hardware).__name__}")
        mesh.hardware = hardware
        return mesh

    # -- geometry ---------------------------------------------------------------------

    def flatten(self, dims: Sequence[str], name: str | None = None) -> "Mesh":
        """This mesh with the adjacent dimensions ``dims`` merged into one, named ``name``
        (default: joined by ``_``, as torch's ``DeviceMesh._flatten``), the same ranks in
        the same order: a rank's index along the merged dimension is its row-major index
        over ``dims``. The other dimensions keep their groups; the merged one gets a group
        per slice, which every rank of this mesh must make (call it on every rank)."""
        dims = tuple(dims)
        index = [self._dim(d) for d in dims]
        if len(dims) < 2 or index != list(range(index[0], index[0] + len(dims))):
            raise ValueError(f"Mesh.flatten: {dims} must be two or more adjacent dimensions of "
                             f"{self}, in order")
        name = name or "_".join(self.dim_names[i] for i in index)
        first, last = index[0], index[-1] + 1
        if name in self.dim_names[:first] + self.dim_names[last:]:
            raise ValueError(f"Mesh.flatten: {self} already has a dimension {name!r}")
        shape = self.shape[:first] + (math.prod(self.shape[first:last]),) + self.shape[last:]
        names = self.dim_names[:first] + (name,) + self.dim_names[last:]
        mesh = Mesh.__new__(Mesh)
        mesh.shape, mesh.dim_names, mesh.simulated = shape, names, self.simulated
        mesh.hardware, mesh.ranks = self.hardware, list(self.ranks)
        mesh._topology, mesh.network = self._topology, self.network
        mesh._groups, mesh._coordinate = {}, None
        if self.simulated or self._coordinate is None:
            return mesh
        mesh._coordinate = mesh.coordinate_of(world("Mesh.flatten").rank)
        for d in range(mesh.ndim):
            if d < first:
                mesh._groups[d] = self._groups[d]
            elif d > first:
                mesh._groups[d] = self._groups[d + last - first - 1]
        state = world("Mesh.flatten")
        state.meshes += 1
        members = mesh._slice(mesh._coordinate, first)
        mesh._groups[first] = new_group(
            members, group_name=f"mesh{state.meshes}/{name}/"
                                f"{mesh._slice_index(mesh._coordinate, first)}")
        return mesh

    def unflatten(self, dim: str, sizes: Sequence[int], names: Sequence[str]) -> "Mesh":
        """This mesh with dimension ``dim`` split into consecutive dimensions of ``sizes``
        named ``names`` (torch's ``DeviceMesh._unflatten``), the same ranks in the same
        order: ``Mesh(8).unflatten("dp", (2, 4), ("node", "local"))`` puts ranks 0-3 on
        node 0. The other dimensions keep their groups; each new one gets a group per
        slice, which every rank of this mesh must make (call it on every rank)."""
        index = self._dim(dim)
        sizes, names = tuple(int(n) for n in sizes), tuple(names)
        if len(sizes) < 2 or len(names) != len(sizes) or any(n < 1 for n in sizes):
            raise ValueError(f"Mesh.unflatten: {len(sizes)} sizes {sizes} and {len(names)} "
                             f"names {names}: pass two or more of each")
        if math.prod(sizes) != self.shape[index]:
            raise ValueError(f"Mesh.unflatten: sizes {sizes} do not multiply to the "
                             f"{self.shape[index]} ranks of {dim!r}")
        others = self.dim_names[:index] + self.dim_names[index + 1:]
        if len(set(names)) != len(names) or set(names) & set(others):
            raise ValueError(f"Mesh.unflatten: names {names} must be new and distinct "
                             f"(the mesh keeps {others})")
        mesh = Mesh.__new__(Mesh)
        mesh.shape = self.shape[:index] + sizes + self.shape[index + 1:]
        mesh.dim_names = self.dim_names[:index] + names + self.dim_names[index + 1:]
        mesh.simulated, mesh.hardware, mesh.ranks = self.simulated, self.hardware, list(self.ranks)
        mesh._topology, mesh.network = self._topology, self.network
        mesh._groups, mesh._coordinate = {}, None
        if self.simulated or self._coordinate is None:
            return mesh
        state = world("Mesh.unflatten")
        mesh._coordinate = mesh.coordinate_of(state.rank)
        new = range(index, index + len(sizes))
        for d in range(mesh.ndim):
            if d < index:
                mesh._groups[d] = self._groups[d]
            elif d >= index + len(sizes):
                mesh._groups[d] = self._groups[d - len(sizes) + 1]
        state.meshes += 1
        for d in new:
            members = mesh._slice(mesh._coordinate, d)
            mesh._groups[d] = new_group(
                members, group_name=f"mesh{state.meshes}/{mesh.dim_names[d]}/"
                                    f"{mesh._slice_index(mesh._coordinate, d)}")
        return mesh

    def __getitem__(self, dims: str | Sequence[str]) -> "Mesh":
        """The sub-mesh of ``dims`` through this rank (torch's ``mesh["dp", "tp"]``): the
        ranks that share this rank's coordinates on every other dimension, with the same
        groups (no new group is made). On a simulated mesh, the slice through rank 0."""
        names = (dims,) if isinstance(dims, str) else tuple(dims)
        index = [self._dim(d) for d in names]
        if not names or len(set(index)) != len(index) or index != sorted(index):
            raise ValueError(f"Mesh[{names!r}]: name distinct dimensions of {self}, in order")
        coord = (self._coordinate if self._coordinate is not None
                 else (0,) * self.ndim)
        if not self.simulated:
            self._live("__getitem__")
        mesh = Mesh.__new__(Mesh)
        mesh.shape = tuple(self.shape[i] for i in index)
        mesh.dim_names = names
        mesh.simulated, mesh.hardware = self.simulated, self.hardware
        mesh._topology, mesh.network = self._topology, self.network
        ranks = []
        for sub in itertools.product(*(range(self.shape[i]) for i in index)):
            full = list(coord)
            for i, c in zip(index, sub):
                full[i] = c
            ranks.append(self.rank_at(full))
        mesh.ranks = ranks
        mesh._groups = {k: self._groups[i] for k, i in enumerate(index) if i in self._groups}
        mesh._coordinate = (None if self._coordinate is None
                            else tuple(self._coordinate[i] for i in index))
        return mesh

    def rename(self, dim_names: Sequence[str]) -> "Mesh":
        """This mesh with its dimensions called ``dim_names`` (the same ranks and groups,
        no new group): how ``strategy="auto"`` names the roles it gives a mesh's
        dimensions (``"dp"``, ``"fsdp"``, ``"tp"``) whatever the user called them."""
        names = _names(dim_names, self.ndim)
        mesh = Mesh.__new__(Mesh)
        mesh.shape, mesh.dim_names, mesh.simulated = self.shape, names, self.simulated
        mesh.hardware, mesh.ranks = self.hardware, list(self.ranks)
        mesh._topology, mesh.network = self._topology, self.network
        mesh._groups, mesh._coordinate = dict(self._groups), self._coordinate
        return mesh

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def topology(self) -> Topology:
        """Where the mesh's ranks run (indexed by global rank): on a simulated mesh the
        hardware model's nodes (``ranks_per_node`` consecutive ranks each), or the topology
        it was made with, else one host; on a live one the job's (:func:`get_topology`)."""
        if self._topology is not None:
            return self._topology
        if self.simulated:
            size = max(self.ranks) + 1  # a sub-mesh's ranks are the whole mesh's
            per = getattr(self.hardware, "ranks_per_node", None) or size
            return Topology.uniform(size, per)
        return get_topology()

    def hosts_along(self, dim: int | str) -> int:
        """The most hosts any slice along ``dim`` spans (1: its collectives stay inside
        hosts)."""
        topo = self.topology
        return max(len(topo.split(s)) for s in self.slices(dim))

    def crosses_hosts(self, dim: int | str) -> bool:
        """Whether collectives along ``dim`` cross the network between hosts."""
        return self.hosts_along(dim) > 1

    def _dim(self, dim: int | str) -> int:
        if isinstance(dim, str):
            if dim not in self.dim_names:
                raise ValueError(f"Mesh has no dimension {dim!r}; it has {self.dim_names}")
            return self.dim_names.index(dim)
        if not isinstance(dim, int) or not -self.ndim <= dim < self.ndim:
            raise ValueError(f"Mesh dimension {dim!r} is out of range for {self.ndim} dimensions")
        return dim % self.ndim

    def size(self, dim: int | str | None = None) -> int:
        """Ranks along ``dim``, or in the whole mesh."""
        return math.prod(self.shape) if dim is None else self.shape[self._dim(dim)]

    def coordinate_of(self, rank: int) -> tuple[int, ...]:
        """Where global rank ``rank`` sits in the grid."""
        try:
            index = self.ranks.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not in this mesh (ranks {self.ranks})") from None
        coord = []
        for extent in reversed(self.shape):
            coord.append(index % extent)
            index //= extent
        return tuple(reversed(coord))

    def rank_at(self, coordinate: Sequence[int]) -> int:
        """The global rank at ``coordinate``."""
        coord = tuple(coordinate)
        if len(coord) != self.ndim or any(not 0 <= c < e for c, e in zip(coord, self.shape)):
            raise ValueError(f"coordinate {coord} is outside the mesh {self.shape}")
        return self.ranks[_flat_index(coord, self.shape)]

    def _slice(self, coord: tuple[int, ...], dim: int) -> list[int]:
        return [self.rank_at(coord[:dim] + (i,) + coord[dim + 1:]) for i in range(self.shape[dim])]

    def _slice_index(self, coord: tuple[int, ...], dim: int) -> int:
        return _flat_index(coord[:dim] + coord[dim + 1:], self.shape[:dim] + self.shape[dim + 1:])

    def slices(self, dim: int | str) -> list[list[int]]:
        """Every slice along ``dim``: the rank lists whose process groups the mesh builds."""
        d = self._dim(dim)
        others = [range(e) for i, e in enumerate(self.shape) if i != d]
        out = []
        for rest in itertools.product(*others):
            coord = rest[:d] + (0,) + rest[d:]
            out.append(self._slice(coord, d))
        return out

    # -- this rank --------------------------------------------------------------------

    def _live(self, what: str) -> None:
        if self.simulated:
            raise RuntimeError(f"Mesh.{what}: a simulated mesh has no processes; it is for "
                               f"planning only")
        if self._coordinate is None:
            raise RuntimeError(f"Mesh.{what}: this rank is not in the mesh (ranks {self.ranks})")

    def coordinate(self) -> tuple[int, ...]:
        """This rank's coordinate in the grid."""
        self._live("coordinate")
        assert self._coordinate is not None
        return self._coordinate

    def get_group(self, dim: int | str = 0) -> ProcessGroup:
        """The process group of this rank's slice along ``dim``."""
        d = self._dim(dim)
        self._live("get_group")
        return self._groups[d]

    def to_torch(self, device_type: str | None = None) -> Any:
        """This mesh as a ``torch.distributed.device_mesh.DeviceMesh`` over the same process
        groups (torch sees them: see :meth:`ProcessGroup.to_torch`), for DTensor and
        ``torch.distributed.checkpoint``. ``device_type``: ``"cpu"`` for Gloo groups,
        ``"cuda"`` for NCCL (the default follows the backend). No new group is made."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        self._live("to_torch")
        groups = [self._groups[d].to_torch() for d in range(self.ndim)]
        if device_type is None:
            device_type = "cuda" if self._groups[0].backend == "nccl" else "cpu"
        layout = torch.tensor(self.ranks, dtype=torch.int).view(self.shape)
        return DeviceMesh.from_group(groups if self.ndim > 1 else groups[0], device_type,
                                     mesh=layout, mesh_dim_names=self.dim_names)

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape))
        kind = "simulated " if self.simulated else ""
        hosts = (f" on {self._topology.num_hosts} hosts" if self._topology is not None
                 and self._topology.num_hosts > 1 else "")
        return f"Mesh({kind}{dims}{hosts})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Mesh) and self.shape == other.shape
                and self.dim_names == other.dim_names and self.ranks == other.ranks
                and self.simulated == other.simulated)

    def __hash__(self) -> int:
        return hash((self.shape, self.dim_names, tuple(self.ranks), self.simulated))
