"""Pure core: states, backoff, routing, task ids, settings."""

from __future__ import annotations

import random

import pytest

from orchestrator.core.backoff import Backoff, Jitter
from orchestrator.core.config import Settings
from orchestrator.core.errors import ConfigurationError
from orchestrator.core.protocol import parse_task_id, task_id
from orchestrator.core.routing import Priority, default_queues, route
from orchestrator.core.states import TRANSITIONS, IllegalTransition, TaskState, check_transition

T = TaskState


def test_transition_table_is_enforced() -> None:
    check_transition(T.QUEUED, T.RUNNING, "worker")
    with pytest.raises(IllegalTransition):
        check_transition(T.SUCCEEDED, T.RUNNING, "worker")
    with pytest.raises(IllegalTransition):
        check_transition(T.READY, T.QUEUED, "worker")  # only the dispatcher admits
    # a terminal task only leaves its state by an operator's hand
    assert all(actors == {"operator"} for (src, _), actors in TRANSITIONS.items() if src.terminal)


def test_backoff_full_jitter_stays_under_capped_ceiling() -> None:
    b = Backoff(base=1.0, cap=10.0, jitter=Jitter.FULL)
    rng = random.Random(7)
    assert [b.ceiling(n) for n in (1, 2, 3, 4, 5, 50)] == [1, 2, 4, 8, 10, 10]
    for n in range(1, 40):
        assert 0 <= b.delay(n, rng) <= b.ceiling(n)
    equal = Backoff(base=2.0, cap=100.0, jitter=Jitter.EQUAL)
    assert all(2.0 <= equal.delay(2, rng) <= 4.0 for _ in range(100))
    assert Backoff(base=3, cap=5, jitter=Jitter.NONE).delay(3) == 5
    with pytest.raises(ValueError):
        b.delay(0)


def test_routing() -> None:
    assert route("acme", Priority.HIGH) == "orchestrator.high"
    assert route("acme", Priority.LOW, dedicated_tenants=["acme"]) == "orchestrator.tenant.acme.low"
    assert route("acme", Priority.LOW, queue="gpu") == "gpu"
    assert set(default_queues(["acme"])) >= {"orchestrator.default", "orchestrator.tenant.acme.high"}


def test_task_id_round_trip() -> None:
    assert parse_task_id(task_id("abc", "extract_1", 3)) == ("abc", "extract_1", 3)
    assert parse_task_id("8c1f1a0e-uuid-like") is None
    assert parse_task_id(task_id("abc", "section_1.sub.normal[2]", 4)) == ("abc", "section_1.sub.normal[2]", 4)
    assert parse_task_id("abc..4") is None and parse_task_id(".k.4") is None and parse_task_id("abc.k.x") is None


def test_settings_from_env_and_errors(tmp_path: object) -> None:
    s = Settings.from_env(
        {"ORCHESTRATOR_DATA_DIR": "/tmp/x", "ORCHESTRATOR_LEASE_SECONDS": "7", "ORCHESTRATOR_DEDICATED_TENANTS": "a, b"}
    )
    assert s.embedded and s.database_url == "embedded:///tmp/x/pg"
    assert s.lease_seconds == 7.0 and s.dedicated_tenants == ("a", "b")
    with pytest.raises(ConfigurationError, match="ORCHESTRATOR_DISPATCH_WINDOW"):
        Settings.from_env({"ORCHESTRATOR_DISPATCH_WINDOW": "lots"})


def test_fanin_stripes_setting() -> None:
    assert Settings.from_env({}).fanin_stripes == 16
    assert Settings.from_env({"ORCHESTRATOR_FANIN_STRIPES": "0"}).fanin_stripes == 0
    for bad in ("-1", "1025"):
        with pytest.raises(ConfigurationError, match=f"ORCHESTRATOR_FANIN_STRIPES={bad} must be 0"):
            Settings.from_env({"ORCHESTRATOR_FANIN_STRIPES": bad})
    with pytest.raises(ConfigurationError, match="ORCHESTRATOR_FANIN_STRIPES"):
        Settings.from_env({"ORCHESTRATOR_FANIN_STRIPES": "many"})
