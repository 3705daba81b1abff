"""Fixtures for the integration tests (the shared ones are in tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _kernels(compiled_kernels):
    """Every integration test starts processes: the kernels are in numba's cache first (tests/conftest.py)."""
