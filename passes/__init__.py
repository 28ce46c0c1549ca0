"""FX graph passes of autoplan: trace -> strategies -> solve -> apply (codegen).

Each pass has an explicit contract stated in its module docstring. The order the planner runs them
in is listed once, as code, in :mod:`autoplan.passes.pass_order` (``PASS_ORDER``: each entry's
function and its one-line input -> output contract); the planner calls every pass through it.
"""
