"""``strategy="auto"``: the layout search.

- :mod:`~spmd.auto.search`: the entry points (``plan_auto``), the memory budget, the result;
- :mod:`~spmd.auto.candidates`: the role of each mesh dimension and the layouts compared;
- :mod:`~spmd.auto.program`: one role assignment as an integer program (groups, variables,
  costs);
- :mod:`~spmd.auto.solver`: the integer program itself, solved by HiGHS (``scipy.optimize.milp``);
- :mod:`~spmd.auto.pipeline`: the outer loop over pipeline stages;
- :mod:`~spmd.auto.live`: the search on a live mesh, finalists measured on every rank.
"""
