"""Fixtures for the model tests (the tiny model itself is built once in tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tools():
    from closedloop.models.tiny import tool_schemas

    return tool_schemas()
