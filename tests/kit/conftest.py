"""The kit's own tests: their tasks registered on the project's app, as a user's DAG module
registers its tasks by importing them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.kit import kit_tasks


@pytest.fixture(autouse=True)
def _calls() -> Iterator[None]:
    kit_tasks.CALLS.clear()
    yield
