"""Checkpoints of parallelized models.

- :mod:`spmd.checkpoint.state_dict`: each rank's part of the model and optimizer state
  for ``torch.distributed.checkpoint`` under any layout (``get_state_dict``,
  ``set_state_dict``, ``ChunkedTensor``), loadable under any other.
- :mod:`spmd.checkpoint.manager`: :class:`CheckpointManager`, asynchronous and atomic
  checkpoints every N steps, the last k kept, and resume from the latest complete one.
"""

from spmd.checkpoint.manager import CheckpointError, CheckpointManager, SaveStats, check_checkpoint
from spmd.checkpoint.state_dict import ChunkedTensor, chunks_of, get_state_dict, set_state_dict

__all__ = ["ChunkedTensor", "get_state_dict", "set_state_dict", "chunks_of", "CheckpointManager",
           "CheckpointError", "SaveStats", "check_checkpoint"]
