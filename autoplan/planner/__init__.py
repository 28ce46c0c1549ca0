"""Planner: decides a :class:`~autoplan.planner.plan.Plan` from a traced program and a cluster.

The per-operator sharding ILP (``solver``) and the plan of one traced step on one mesh (``ilp``:
strategies, pins, costs, the ILP, then the chosen program's collectives, overlap and memory), the
cluster argument and planning meshes (``mesh``), the tracing the planner prices (``tracing``), the
per-segment costs that the joint search reads (``segment_costs``, with the ``SegmentCostOracle``
protocol, and ``segment_model``: the oracle with its forked workers), the joint search over
data/tensor/pipeline degrees, micro-batches, schedule, recomputation and ZeRO (``search``,
``joint``; each configuration priced by :mod:`autoplan.cost_models.step`), the plan value itself
(``plan``) and its cache
(``plan_cache``). Graph passes run through :mod:`autoplan.passes.pass_order`. Depends on
the cost models and graph passes; never on the runtime or the tools.
"""
