"""spmd.runtime.autograd: distributed autograd over ``spmd.runtime.rpc``.

The API of ``torch.distributed.autograd``: ``context``, ``backward``, ``get_gradients``.

Example::

    from spmd.runtime import autograd as dist_autograd, rpc

    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync("worker1", torch.matmul, args=(x, w))
        dist_autograd.backward(context_id, [out.sum()])
        grads = dist_autograd.get_gradients(context_id)
"""

from spmd.runtime.autograd.contexts import DistAutogradContext, context
from spmd.runtime.autograd.engine import backward, get_gradients

__all__ = ["context", "backward", "get_gradients", "is_available", "DistAutogradContext"]


def is_available() -> bool:
    """True: distributed autograd needs only torch and ``spmd.runtime.rpc``."""
    return True
