"""The Postgres hot path (server functions of migration 0004) against the Python code it mirrors."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from orchestrator import DAG
from orchestrator import schema as s
from orchestrator.routing import default_queues, route
from orchestrator.states import TriggerRule, UpstreamCounts, decide
from orchestrator.store import Store

pytestmark = pytest.mark.postgres


@pytest.fixture
def store(pg_url: str) -> Iterator[Store]:
    st = Store(pg_url)
    with st.engine.begin() as conn:
        for table in reversed(s.metadata.sorted_tables):
            conn.execute(table.delete())
    st.workers.register("w", default_queues(), 100)
    yield st
    if st.attempts.hot is not None:
        st.attempts.hot.close()
    st.dispose()


def test_the_sql_trigger_rules_are_states_decide(store: Store) -> None:
    cases = []
    for rule in TriggerRule:
        for total in range(1, 4):
            for ok, failed, skipped in itertools.product(range(total + 1), repeat=3):
                if ok + failed + skipped <= total:
                    cases.append((rule, UpstreamCounts(total, ok + failed + skipped, ok, failed, skipped)))
    with store.engine.connect() as conn:
        for rule, c in cases:
            got = conn.execute(
                sa.text("SELECT orc_decide(:r, :t, :d, :o, :f, :s)"),
                {"r": rule.value, "t": c.total, "d": c.done, "o": c.succeeded, "f": c.failed, "s": c.skipped},
            ).scalar_one()
            want = decide(rule, c)
            assert got == (want.value if want else None), (rule, c)


def test_the_hot_path_survives_a_terminated_session(store: Store) -> None:
    dag = DAG("reconnect")
    dag.task("a", "t")
    dag.task("b", "t", upstream=["a"])
    run_id, _ = store.submission.create_run(
        dag, queues={k: route("default", dag.priority) for k in dag.nodes}, wants_upstream=lambda _: True
    )
    store.admission.admit_ready(10)
    assert store.attempts.claim(run_id, "a", 1, "w", 30) is not None
    # the server drops the hot path's session (a Postgres restart, an admin's terminate)
    with store.engine.connect() as conn:
        conn.execute(
            sa.text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid() AND query LIKE '%orc_claim%'"
            )
        )
    out = store.attempts.succeed(run_id, "a", 1, {"x": 1}, 10)
    assert out.accepted and [(d.key, d.attempt) for d in out.dispatches] == [("b", 1)]
    claim = store.attempts.claim(run_id, "b", 1, "w", 30)
    assert claim is not None and claim.upstream_results == {"a": {"x": 1}}
