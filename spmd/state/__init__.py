"""Where parameters live: one placement record per parameter and the views of it.

- :mod:`~spmd.state.layout`: the placement layer (stored and computed placements, the class
  swap, state-dict hooks);
- :mod:`~spmd.state.writethrough`: a parameter stored in pieces as eager code sees it;
- :mod:`~spmd.state.ownership`: the modules of a parallelized model;
- :mod:`~spmd.state.chunked`: one rank's part of a whole tensor for DCP (``spmd.checkpoint``);
- :mod:`~spmd.state.rng`: the random generators' state, taken and put back whole.
"""
