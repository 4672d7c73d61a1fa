"""One rank's part of a whole tensor, as ``torch.distributed.checkpoint`` (DCP) reads and
writes it: :class:`ChunkedTensor`. ``spmd.checkpoint`` makes them (its module doc says
where the chunks come from); a placed model's ``load_state_dict`` takes them back."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Chunk", "ChunkedTensor"]

# (offsets in this rank's stored part, offsets in the whole tensor, sizes)
Chunk = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


class ChunkedTensor(torch.Tensor):
    """A whole tensor of which this rank holds some rectangular chunks, for DCP.

    Its shape and dtype are the whole tensor's; :meth:`to_local` is this rank's stored
    part (a shard with its padding, a tensor-parallel piece, or a shard of a piece), and
    each chunk names a block of that part and the offsets of the same block in the whole.
    It implements DCP's checkpointable protocol (``__create_write_items__``,
    ``__create_chunk_list__``, ``__get_tensor_shard__``) and nothing else: compute on it
    raises ``RuntimeError`` (a ``TypeError`` would become Python's "unsupported operand").
    ``set_state_dict`` or the model's ``load_state_dict`` takes it back."""

    _local: torch.Tensor
    _chunks: tuple[Chunk, ...]

    @staticmethod
    def __new__(cls, local: torch.Tensor, shape: tuple[int, ...], chunks: tuple[Chunk, ...]
                ) -> "ChunkedTensor":
        out = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=local.dtype,
                                                  device=local.device, requires_grad=False)
        out._local = local
        out._chunks = chunks
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        raise RuntimeError(f"spmd.checkpoint.ChunkedTensor does not compute ({func}): it is this "
                        f"rank's part of a whole tensor, for torch.distributed.checkpoint; "
                        f"load it with spmd.checkpoint.set_state_dict (or the model's "
                        f"load_state_dict), or read .to_local(); model.state_dict() gives "
                        f"whole tensors")

    def __repr__(self) -> str:  # type: ignore[override]
        return (f"ChunkedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"local={tuple(self._local.shape)}, chunks={len(self._chunks)})")

    def to_local(self) -> torch.Tensor:
        """This rank's stored part (shares memory with it)."""
        return self._local

    def _block(self, chunk: Chunk) -> torch.Tensor:
        start, _, sizes = chunk
        if not sizes:
            return self._local.reshape(-1)[0]  # a 0-dim tensor: its one stored row
        out = self._local
        for dim, (at, n) in enumerate(zip(start, sizes)):
            out = out.narrow(dim, at, n)
        return out

    def __create_write_items__(self, fqn: str, object: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata, MetadataIndex, TensorProperties)
        from torch.distributed.checkpoint.planner import (
            TensorWriteData, WriteItem, WriteItemType)

        properties = TensorProperties.create_from_tensor(self._local)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(at)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(at),
                                                         sizes=torch.Size(sizes)),
                              properties=properties, size=self.size()))
                for _, at, sizes in self._chunks]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(at), sizes=torch.Size(sizes))
                for _, at, sizes in self._chunks]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        for chunk in self._chunks:
            if torch.Size(chunk[1]) == index.offset:
                return self._block(chunk)
        raise ValueError(f"spmd.checkpoint: {index.fqn} has no chunk at {index.offset} on "
                         f"this rank")
