"""Shared pytest configuration: marker registration only."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes over a minute on 2 CPU cores; deselect with -m 'not slow'")
