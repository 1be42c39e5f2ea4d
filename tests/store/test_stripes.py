"""Striped fan-ins (migration 0038, store/stripes.py): a wide join counts its plain parents'
successes in stripes; the join's row and the run's are written when a stripe fills, a failure is
counted at once, and clear, retry, cancel, explain and concurrent arrivals keep every count exact."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG
from orchestrator.core.models import operator
from orchestrator.core.routing import default_queues, route
from orchestrator.core.states import RunState, TaskState, TriggerRule
from orchestrator.store import Store
from orchestrator.store.stripes import fan_in_stripes

pytestmark = pytest.mark.postgres

T = TaskState
OP = operator("alice")
WIDTH = 16  # with 2 stripes of 8 parents each (at least 4 parents a stripe)
STRIPES = 2


@pytest.fixture
def store(pg_clean: str) -> Iterator[Store]:
    st = Store(pg_clean, dispatch_depth=1)
    st.workers.register("test-worker", default_queues(), 10_000)
    yield st
    st.dispose()


def fan_in(rule: TriggerRule = TriggerRule.ALL_SUCCESS, width: int = WIDTH) -> DAG:
    dag = DAG("striped")
    dag.task("root", "t")
    for i in range(width):
        dag.task(f"m{i:02d}", "t", upstream=["root"])
    dag.task("join", "t", upstream=[f"m{i:02d}" for i in range(width)], trigger_rule=rule)
    return dag


def submit(store: Store, dag: DAG, stripes: int = STRIPES) -> str:
    queues = {n.key: route(dag.tenant, dag.priority_of(n), n.queue) for n in dag.nodes.values()}
    run_id, _ = store.submission.create_run(dag, queues=queues, wants_upstream=lambda name: True, stripes=stripes)
    return run_id


def run_task(store: Store, run_id: str, key: str, *, ok: bool = True) -> None:
    store.admission.admit_ready(10_000)
    task = store.reads.get_task(run_id, key)
    assert task.state is T.QUEUED, (key, task.state)
    assert store.attempts.claim(run_id, key, task.attempt, "w1", 30, "t") is not None
    if ok:
        assert store.attempts.succeed(run_id, key, task.attempt, None, 10_000).accepted
    else:
        assert store.attempts.fail(run_id, key, task.attempt, error="boom", retryable=False, window=10_000).accepted


def row(store: Store, sql: str, **params: Any) -> Any:
    with store.engine.connect() as conn:
        return conn.execute(sa.text(sql), params).one()


def join_counts(store: Store, run_id: str) -> tuple[int, int, int]:
    r = row(store, "SELECT n_done, n_succeeded, n_failed FROM orc_tasks WHERE run_id = :r AND key = 'join'", r=run_id)
    return r.n_done, r.n_succeeded, r.n_failed


def open_tasks(store: Store, run_id: str) -> int:
    return int(row(store, "SELECT open_tasks FROM orc_runs WHERE id = :r", r=run_id).open_tasks)


def stripe_of(store: Store, run_id: str, key: str) -> int:
    return int(row(store, "SELECT stripe FROM orc_tasks WHERE run_id = :r AND key = :k", r=run_id, k=key).stripe)


def by_stripe(store: Store, run_id: str) -> dict[int, list[str]]:
    with store.engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT key, stripe FROM orc_tasks WHERE run_id = :r AND stripe IS NOT NULL ORDER BY key"),
            {"r": run_id},
        ).all()
    out: dict[int, list[str]] = {}
    for key, stripe in rows:
        out.setdefault(stripe, []).append(key)
    return out


def test_which_joins_are_striped() -> None:
    assert fan_in_stripes(fan_in(), STRIPES).quotas == {"join": [8, 8]}
    assert fan_in_stripes(fan_in(width=7), STRIPES).quotas == {}  # under 4 parents a stripe
    assert fan_in_stripes(fan_in(), 0).quotas == {}  # ORCHESTRATOR_FANIN_STRIPES=0
    # a success could decide these early: never striped
    for rule in (TriggerRule.ONE_SUCCESS, TriggerRule.ONE_DONE, TriggerRule.ALL_FAILED, TriggerRule.ALL_SKIPPED):
        assert fan_in_stripes(fan_in(rule), STRIPES).quotas == {}, rule
    # a parent with another child, or one that is not plain, counts into the join directly
    dag = fan_in()
    dag.task("side", "t", upstream=["m00"])
    dag.task("gate", "t", upstream=["root"], branch=True)
    dag.nodes["join"] = dag.nodes["join"].__class__(**{**vars(dag.nodes["join"]), "upstream": (
        *dag.nodes["join"].upstream, "gate")})  # fmt: skip
    striped = fan_in_stripes(dag, STRIPES)
    assert "m00" not in striped.of and "gate" not in striped.of and len(striped.of) == WIDTH - 1


def test_successes_are_held_until_their_stripe_fills(store: Store) -> None:
    run_id = submit(store, fan_in())
    run_task(store, run_id, "root")
    stripes = by_stripe(store, run_id)
    assert sorted(len(v) for v in stripes.values()) == [8, 8]
    first, second = stripes[0], stripes[1]
    opened = open_tasks(store, run_id)
    for key in first[:-1]:
        run_task(store, run_id, key)
    # seven successes held in stripe 0: the join's row and the run's count are untouched
    assert join_counts(store, run_id) == (0, 0, 0)
    assert open_tasks(store, run_id) == opened
    assert store.reads.get_task(run_id, "m00").state is T.SUCCEEDED
    run_task(store, run_id, first[-1])  # stripe 0 fills: its 8 successes counted and closed
    assert join_counts(store, run_id) == (8, 8, 0)
    assert open_tasks(store, run_id) == opened - 8
    for key in second:
        run_task(store, run_id, key)
    assert join_counts(store, run_id) == (16, 16, 0)
    assert state_of(store, run_id, "join") is T.QUEUED  # READY once, admitted by the last success
    run_task(store, run_id, "join")
    assert store.reads.get_run(run_id).state is RunState.SUCCEEDED
    ready = row(
        store,
        "SELECT count(*) AS n FROM orc_task_events WHERE run_id = :r AND key = 'join' AND to_state = 'READY'",
        r=run_id,
    )
    assert ready.n == 1


def state_of(store: Store, run_id: str, key: str) -> TaskState:
    return store.reads.get_task(run_id, key).state


def test_a_failure_decides_the_join_at_once_and_the_run_waits_for_every_parent(store: Store) -> None:
    run_id = submit(store, fan_in())
    run_task(store, run_id, "root")
    first, second = by_stripe(store, run_id)[0], by_stripe(store, run_id)[1]
    for key in first[:3]:
        run_task(store, run_id, key)
    run_task(store, run_id, second[0], ok=False)
    assert state_of(store, run_id, "join") is T.UPSTREAM_FAILED  # an early verdict, not held
    assert join_counts(store, run_id) == (1, 0, 1)
    assert store.reads.get_run(run_id).state is RunState.RUNNING
    for key in first[3:] + second[1:]:
        run_task(store, run_id, key)
    assert join_counts(store, run_id) == (16, 15, 1)
    assert open_tasks(store, run_id) == 0
    assert store.reads.get_run(run_id).state is RunState.FAILED


def test_a_retried_failed_parent_arrives_again_into_its_stripe(store: Store) -> None:
    run_id = submit(store, fan_in(TriggerRule.ALL_DONE))
    run_task(store, run_id, "root")
    first, second = by_stripe(store, run_id)[0], by_stripe(store, run_id)[1]
    run_task(store, run_id, first[0], ok=False)
    for key in first[1:]:
        run_task(store, run_id, key)  # stripe 0 full: 7 successes and the failure counted
    assert join_counts(store, run_id) == (8, 7, 1)
    assert store.operator.retry_task(run_id, first[0], 100, OP).accepted
    assert join_counts(store, run_id) == (7, 7, 0)
    run_task(store, run_id, first[0])  # fills stripe 0 again: its one success counted
    assert join_counts(store, run_id) == (8, 8, 0)
    for key in second:
        run_task(store, run_id, key)
    assert join_counts(store, run_id) == (16, 16, 0)
    run_task(store, run_id, "join")
    assert store.reads.get_run(run_id).state is RunState.SUCCEEDED


def test_a_clear_counts_the_held_successes_and_each_stripe_again(store: Store) -> None:
    run_id = submit(store, fan_in())
    run_task(store, run_id, "root")
    first, second = by_stripe(store, run_id)[0], by_stripe(store, run_id)[1]
    for key in first[:5] + second:
        run_task(store, run_id, key)  # stripe 1 full, 5 held in stripe 0
    assert join_counts(store, run_id) == (8, 8, 0)
    # clear a held parent: it runs again; the join counts what has ended, stripe 0 what is left
    store.operator.clear_tasks(run_id, [first[0]], OP, 100)
    assert state_of(store, run_id, first[0]) in (T.READY, T.QUEUED)
    assert join_counts(store, run_id) == (12, 12, 0)
    arrived = row(store, "SELECT arrived, pending FROM orc_stripes WHERE run_id = :r AND stripe = 0", r=run_id)
    assert (arrived.arrived, arrived.pending) == (4, 0)
    for key in [first[0], *first[5:]]:
        run_task(store, run_id, key)
    assert join_counts(store, run_id) == (16, 16, 0)
    run_task(store, run_id, "join")
    assert store.reads.get_run(run_id).state is RunState.SUCCEEDED
    # a clear of the whole finished run: every stripe counted again from nothing
    store.operator.clear_tasks(run_id, ["root"], OP, 100, downstream=True)
    assert join_counts(store, run_id) == (0, 0, 0)
    with store.engine.connect() as conn:
        left = conn.execute(sa.text("SELECT sum(arrived) FROM orc_stripes WHERE run_id = :r"), {"r": run_id}).scalar()
    assert left == 0
    run_task(store, run_id, "root")
    for key in first + second:
        run_task(store, run_id, key)
    run_task(store, run_id, "join")
    assert store.reads.get_run(run_id).state is RunState.SUCCEEDED


def test_explain_counts_the_held_successes_as_done(store: Store) -> None:
    run_id = submit(store, fan_in())
    run_task(store, run_id, "root")
    for key in by_stripe(store, run_id)[0][:3]:
        run_task(store, run_id, key)
    explained = store.reads.explain_input(run_id, worker_ttl=30, depth=1, keys=["join"])
    join = next(t for t in explained.tasks if t.key == "join")
    assert (join.n_done, join.n_succeeded) == (3, 3)


def test_a_cancel_with_held_successes_closes_the_run(store: Store) -> None:
    run_id = submit(store, fan_in())
    run_task(store, run_id, "root")
    for key in by_stripe(store, run_id)[0][:3]:
        run_task(store, run_id, key)
    store.operator.cancel_run(run_id, OP)
    run = store.reads.get_run(run_id)
    assert run.state is RunState.CANCELLED
    assert open_tasks(store, run_id) == 0


def test_concurrent_arrivals_make_the_join_ready_once(store: Store) -> None:
    """64 parents in 4 stripes, finished by 8 threads at once: every stripe fills once, the join
    is READY once, the run's open count is exact, and no transaction deadlocks."""
    run_id = submit(store, fan_in(width=64), stripes=4)
    run_task(store, run_id, "root")
    store.admission.admit_ready(10_000)
    keys = [f"m{i:02d}" for i in range(64)]
    for key in keys:
        assert store.attempts.claim(run_id, key, 1, "w1", 30, "t") is not None
    errors: list[BaseException] = []
    chunks = [keys[i::8] for i in range(8)]

    def finish(mine: list[str]) -> None:
        try:
            for key in mine:
                assert store.attempts.succeed(run_id, key, 1, None, 10_000).accepted
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=finish, args=(c,)) for c in chunks]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert join_counts(store, run_id) == (64, 64, 0)
    assert open_tasks(store, run_id) == 1  # the join
    folds = row(store, "SELECT count(*) AS n, sum(arrived) AS a FROM orc_stripes WHERE run_id = :r", r=run_id)
    assert (folds.n, folds.a) == (4, 64)
    run_task(store, run_id, "join")
    assert store.reads.get_run(run_id).state is RunState.SUCCEEDED


def test_a_striped_join_that_a_map_and_a_skip_also_feed(pg_clean: str) -> None:
    """Stripes meet a map (its children count into the join one by one, outside the stripes,
    after its expansion raised the join's n_upstream), a plain parent that skips itself (counted
    at once: none_failed), and a clear of the map with what is below it."""
    from orchestrator import Skip
    from tests.store.dynamic import drive, orchestrator

    orc = orchestrator(pg_clean, fanin_stripes=STRIPES)
    dag = DAG("striped-mixed")
    dag.task("ls", "t")
    dag.map("m", "t", over="ls", kwarg="x")
    for i in range(WIDTH):
        dag.task(f"p{i:02d}", "t", upstream=["ls"])
    dag.task("skipper", "t", upstream=["ls"])
    dag.task("join", "up", upstream=["m", "skipper", *(f"p{i:02d}" for i in range(WIDTH))],
             trigger_rule=TriggerRule.NONE_FAILED)  # fmt: skip

    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        if key == "ls":
            return [1, 2, 3]
        if key == "skipper":
            raise Skip("nothing to do")
        return key

    try:
        d = drive(orc, dag, body)
        assert d.run_state() == "SUCCEEDED", d.states()
        run_id = d.run_id
        store = orc.store
        assert sorted(len(v) for v in by_stripe(store, run_id).values()) == [8, 9]  # the 16 and the skipper
        with store.engine.connect() as conn:
            join = conn.execute(
                sa.text(
                    "SELECT n_upstream, n_done, n_succeeded, n_skipped FROM orc_tasks"
                    " WHERE run_id = :r AND key = 'join'"
                ),
                {"r": run_id},
            ).one()
        assert tuple(join) == (WIDTH + 4, WIDTH + 4, WIDTH + 3, 1)  # 16 plain, the skipper, 3 map children
        assert [k for k, *_ in d.ran].count("join") == 1
        filled = row(store, "SELECT bool_and(arrived = quota AND pending = 0) AS ok FROM orc_stripes WHERE run_id = :r",
                     r=run_id)  # fmt: skip
        assert filled.ok
        # the map cleared with what is below it: its children and the join run again, the
        # plain parents' successes stay counted
        orc.clear(run_id, "m", downstream=True)
        d = drive(orc, dag, body, run_id=run_id)
        assert d.run_state() == "SUCCEEDED", d.states()
        assert [k for k, *_ in d.ran].count("join") == 1
        assert row(store, "SELECT n_done, n_succeeded FROM orc_tasks WHERE run_id = :r AND key = 'join'",
                   r=run_id) == (WIDTH + 4, WIDTH + 3)  # fmt: skip
    finally:
        orc.store.dispose()
