"""Adapters that run an autoplan plan inside another training framework (public API layer: each is
a thin entry over :func:`autoplan.parallelize`). Each imports its framework only where it is used,
so ``import autoplan.integrations`` never needs one installed.

- :mod:`autoplan.integrations.lightning`: a ``parallelize_fn`` for Lightning's
  ``ModelParallelStrategy`` (Fabric), planning on the strategy's device mesh.
"""
