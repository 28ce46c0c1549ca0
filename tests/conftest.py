"""Shared pytest configuration: the slow marker, and a private cache directory per session so
no test reads or writes the user's profile databases (spawned ranks inherit it)."""

import os

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes over a minute on 2 CPU cores; deselect with -m 'not slow'")


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    old = os.environ.get("AUTOPLAN_CACHE_DIR")
    os.environ["AUTOPLAN_CACHE_DIR"] = str(tmp_path_factory.mktemp("autoplan-cache"))
    yield
    if old is None:
        os.environ.pop("AUTOPLAN_CACHE_DIR", None)
    else:
        os.environ["AUTOPLAN_CACHE_DIR"] = old
