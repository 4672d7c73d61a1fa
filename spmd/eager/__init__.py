"""The eager code around the compiled graphs.

- :mod:`~spmd.eager.reducer`: coalesced broadcasts and the reducer of gradients no graph
  averaged; :mod:`~spmd.eager.safety_net`: when it runs;
- :mod:`~spmd.eager.join`: uneven inputs (``spmd.Join``);
- :mod:`~spmd.eager.batchnorm`: batch norms over the whole batch;
- :mod:`~spmd.eager.clip`: gradient clipping over split gradients.
"""
