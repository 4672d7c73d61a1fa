"""What ``spmd.parallelize`` builds on each rank.

- :mod:`~spmd.program.setup`: what every rank does before it plans (mesh, strategy,
  agreement on the model);
- :mod:`~spmd.program.module`: a parallelized ``nn.Module`` instance (:class:`ModuleState`);
- :mod:`~spmd.program.step`: a whole training step in one graph;
- :mod:`~spmd.program.agreement`: what the ranks share while they compile.

Pipelines are :mod:`spmd.pipeline`.
"""
