"""FX graph passes of autoplan: trace -> strategies -> solve -> apply (codegen).

Each pass has an explicit contract stated in its module docstring. The pipeline reads top to
bottom in ``autoplan.api``.
"""
