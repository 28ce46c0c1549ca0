"""The version of autoplan, defined once here, in the lowest layer: the package exports it as
``autoplan.__version__`` and plan files record it (``versions.autoplan``) without importing the
public API."""

__version__ = "0.1.0"
