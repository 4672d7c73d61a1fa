"""Pipeline parallelism below the user's ``spmd.pp`` (:mod:`spmd.pp`: the schedules).

- :mod:`~spmd.pipeline.module`: :class:`~spmd.pipeline.module.PipelineModule`, what
  ``parallelize(model, pipeline=...)`` returns, and its step;
- :mod:`~spmd.pipeline.stage`: one stage as a module;
- :mod:`~spmd.pipeline.split_backward`: a backward split into input and weight gradients
  (zero-bubble schedules);
- :mod:`~spmd.pipeline.plan`: the plan of a pipeline (cut, stages, timeline, bubbles).

The graph is cut into stages in :mod:`spmd.lowering.pipeline` and :mod:`spmd.lowering.stages`.
"""
