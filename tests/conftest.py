"""Shared pytest configuration: the slow marker, a private cache directory per session so
no test reads or writes the user's profile databases (spawned ranks inherit it), and the
catalog's CPU links for ``NxCPU`` (``AUTOPLAN_LOCAL_LINKS=catalog``: plans must not depend on a
calibration of the machine running the tests, and ``autoplan plan`` must not launch one; the
golden snapshots hold catalog-priced plans). Tests of the local calibration set it themselves."""

import os

import pytest

os.environ["AUTOPLAN_LOCAL_LINKS"] = "catalog"  # at import: subprocesses and ranks inherit it


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: outside CI's 15-minute budget on 2 cores (multi-rank variants, slower checks); "
        "CI deselects them with -m 'not slow', -m slow runs them",
    )


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    old = os.environ.get("AUTOPLAN_CACHE_DIR")
    os.environ["AUTOPLAN_CACHE_DIR"] = str(tmp_path_factory.mktemp("autoplan-cache"))
    yield
    if old is None:
        os.environ.pop("AUTOPLAN_CACHE_DIR", None)
    else:
        os.environ["AUTOPLAN_CACHE_DIR"] = old
