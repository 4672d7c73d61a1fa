"""spmd.kernels: Triton kernels for the memory-bound work around collectives.

- ``pack`` / ``unpack``: many tensors into one flat bucket and back, scaled and cast on the
  way, in one launch.
- ``reduce_chunks``: the ``p`` chunks of a bucket segment a rank receives in a low-precision
  all-reduce (bfloat16, float16 or float8 with a scale per chunk) summed in float32, scaled
  and written once, in one launch; ``quantize_chunks`` is the sender's side.
- ``sgd_step`` / ``adamw_step``: the optimizer applied straight from a reduced flat gradient
  bucket, parameters and state updated in one launch, matching ``torch.optim``.
- ``grouped.grouped_mm`` / ``grouped.grouped_mm_weight``: a mixture of experts' products,
  one matrix per expert over rows laid out expert by expert, and the weights' gradient,
  one launch each (the experts' offsets read on the device).
- ``implementation(device)``: ``"triton"`` or ``"torch"``, what the calls above use there
  (``SPMD_KERNELS``: ``auto``, ``torch`` or ``triton``; see ``spmd.kernels.dispatch``).

Triton on CUDA tensors, the plain-torch reference on CPU. Importing this package does not
import Triton; the first Triton launch does.
"""

import sys

if __name__ == "kernels":  # pragma: no cover - the repository root is on sys.path
    # This folder is spmd.kernels. Imported as a top-level ``kernels`` (the repository root
    # on sys.path: ``python -m pytest`` or a script run from it), it would shadow PyPI's
    # ``kernels`` (Hugging Face's kernel hub, which transformers >= 5.25 imports): load
    # that package in its place, or say why none can be.
    def _installed() -> None:
        import importlib.machinery
        import importlib.util
        import os

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        for entry in sys.path:
            if os.path.abspath(entry or os.getcwd()) == root:
                continue
            spec = importlib.machinery.PathFinder.find_spec("kernels", [entry])
            if spec is not None and spec.loader is not None:
                module = importlib.util.module_from_spec(spec)
                sys.modules["kernels"] = module  # what the import statement returns
                spec.loader.exec_module(module)
                return
        raise ImportError("'kernels' here is spmd's kernels folder, imported as "
                          "spmd.kernels; no other package named 'kernels' is installed")

    _installed()

from spmd.kernels.dispatch import implementation, kernels_setting
from spmd.kernels.optim import adamw_step, sgd_step
from spmd.kernels.packing import pack, unpack
from spmd.kernels.reduce import quantize_chunks, reduce_chunks

__all__ = ["pack", "unpack", "reduce_chunks", "quantize_chunks", "sgd_step", "adamw_step",
           "implementation", "kernels_setting"]
