"""Tools: the ``autoplan`` command line and the review, report, benchmark, calibration,
profiling and ONNX-export commands it runs. A thin layer over the public API (``autoplan.api``)
and the plan value; helpers shared between the commands are public inside this package.
"""
