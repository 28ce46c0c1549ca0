"""Tools: the ``autoplan`` command line and the review, report, benchmark, calibration,
profiling and ONNX-export commands it runs. A thin layer over the public API (``autoplan.api``)
and the plan value. One module per command group registers its arguments and handler
(``planning``, ``review``, ``run``, ``calibrate``, ``profile``, ``report``, ``bench``; ``export-onnx``
is registered by ``cli``); what they share is public in ``common``; ``cli`` assembles them.
Dependencies point one way: command modules -> ``common`` and ``console``; ``cli`` -> command modules.
"""
