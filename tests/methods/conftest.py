"""Tiny models decode token by token here; on a shared 2-core box two intra-op threads make such
loops many times slower, so these tests run on one thread.
"""
import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test in this folder uses the shared ``one_thread`` fixture (tests/conftest.py)."""
    yield
