"""Planner: decides a :class:`~autoplan.planner.plan.Plan` from a traced program and a cluster.

The per-operator sharding ILP (``solver``), the per-segment costs that the joint search reads
(``segment_costs``), the joint search over data/tensor/pipeline degrees, micro-batches, schedule,
recomputation and ZeRO (``search``, ``joint``), the plan value itself (``plan``) and its cache
(``plan_cache``). Depends on the cost models and graph passes; never on the runtime or the tools.
"""
