"""What the compiler decided, and what it costs, for people to read.

- :mod:`~spmd.plan.plan`: :class:`~spmd.plan.plan.Plan`, built from the captured graphs;
- :mod:`~spmd.plan.planning`: plans made without processes (``spmd.inspect``, the search);
- :mod:`~spmd.plan.memory`, :mod:`~spmd.plan.timeline`, :mod:`~spmd.plan.roofline`: the
  memory view, the timeline and the compute cost model (with :mod:`spmd.hardware`'s models);
- :mod:`~spmd.plan.views`: graphs, explanations, figures, HTML;
- :mod:`~spmd.plan.profiling`: ``spmd.profile``, what a run really did.
"""
