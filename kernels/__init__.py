"""spmd.kernels: Triton kernels for the memory-bound work around collectives.

- ``pack`` / ``unpack``: many tensors into one flat bucket and back, scaled and cast on the
  way, in one launch.
- ``sgd_step`` / ``adamw_step``: the optimizer applied straight from a reduced flat gradient
  bucket, parameters and state updated in one launch, matching ``torch.optim``.
- ``implementation(device)``: ``"triton"`` or ``"torch"``, what the calls above use there
  (``SPMD_KERNELS``: ``auto``, ``torch`` or ``triton``; see ``spmd.kernels.dispatch``).

Triton on CUDA tensors, the plain-torch reference on CPU. Importing this package does not
import Triton; the first Triton launch does.
"""

from spmd.kernels.dispatch import implementation, kernels_setting
from spmd.kernels.optim import adamw_step, sgd_step
from spmd.kernels.packing import pack, unpack

__all__ = ["pack", "unpack", "sgd_step", "adamw_step", "implementation", "kernels_setting"]
