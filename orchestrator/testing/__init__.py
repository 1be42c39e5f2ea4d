"""A test kit for DAGs: run a DAG in the test's process through the production transitions,
on a real PostgreSQL, with time, events and faults as test inputs.

>>> from orchestrator.testing import run_dag, FailTimes
>>> result = run_dag(dag, faults={"charge": FailTimes(2, exc=TimeoutError)})
>>> assert result.state == "SUCCEEDED", result.explain("charge")

Installed with the package as a pytest plugin (``orchestrator.testing.plugin``): the fixtures
``orchestrator`` (a :class:`Kit`: ``run_dag``, ``emit``, ``signal``, ``approve``, ``clock``) and
``orchestrator_db`` (the kit's database, emptied for each test). See docs/testing.md.
"""

from __future__ import annotations

from .app import InProcessPublisher
from .clock import Clock
from .database import KitDatabase
from .inputs import CrashWorker, FailTimes, Fault, Input, KitError, LoseDispatch, approve, emit, reject, signal
from .results import Delivery, RunResult
from .runner import Kit, current_kit, run_dag

__all__ = [
    "Clock",
    "CrashWorker",
    "Delivery",
    "FailTimes",
    "Fault",
    "InProcessPublisher",
    "Input",
    "Kit",
    "KitDatabase",
    "KitError",
    "LoseDispatch",
    "RunResult",
    "approve",
    "current_kit",
    "emit",
    "reject",
    "run_dag",
    "signal",
]
