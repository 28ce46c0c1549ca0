"""Adapters that run an autoplan plan inside another training framework (public API layer: each is
a thin entry over :func:`autoplan.parallelize`). Each imports its framework only where it is used,
so ``import autoplan.integrations`` never needs one installed.

- :mod:`autoplan.integrations.lightning`: a ``parallelize_fn`` for Lightning's
  ``ModelParallelStrategy`` (Fabric's ``setup_module``, or a ``LightningModule``'s
  ``configure_model`` under the ``Trainer``), planning on the strategy's device mesh;
- :mod:`autoplan.integrations.torchtitan`: a ``parallelize_fn(model, parallel_dims, job_config)``
  in torchtitan's form, planning on the world mesh of its ``ParallelDims``.
"""
