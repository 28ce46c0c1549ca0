"""Runtime: turns a plan into the per-rank program that trains.

Code generation (``codegen``: the plan applied to the traced graph, with the collectives of
``collectives``), the data-parallel/tensor-parallel model (``parallel``), the pipeline model over
``torch.distributed.pipelining`` (``pipeline``), sharded checkpoints (``checkpoint``), optimizers,
on-device timing of operators (``op_timing``) and of whole steps (``step_timing``), and process
group teardown. Depends on the planner's ``Plan`` value, the graph passes and the cost models.
"""
