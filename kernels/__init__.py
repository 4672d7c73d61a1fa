"""spmd.kernels: Triton kernels for the memory-bound work around collectives.

- ``pack`` / ``unpack``: many tensors into one flat bucket and back, scaled and cast on the
  way, in one launch.
- ``reduce_chunks``: the ``p`` chunks of a bucket segment a rank receives in a low-precision
  all-reduce (bfloat16, float16 or float8 with a scale per chunk) summed in float32, scaled
  and written once, in one launch; ``quantize_chunks`` is the sender's side.
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
from spmd.kernels.reduce import quantize_chunks, reduce_chunks

__all__ = ["pack", "unpack", "reduce_chunks", "quantize_chunks", "sgd_step", "adamw_step",
           "implementation", "kernels_setting"]
