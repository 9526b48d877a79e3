"""Fixtures the integration modules share: one event loop thread per module, on which
each test serves its Coordinator apps."""

from __future__ import annotations

import pytest

from tests.unit.coordinator.harness import LoopThread


@pytest.fixture(scope="module")
def loop():
    lt = LoopThread()
    yield lt
    lt.close()
