"""Prometheus metrics from the database (``orchestrator.web.metrics.render``), on SQLite and Postgres:
real state built through the engine and the store (submits, claims, successes, failures, a dead
letter, a lease expiry and a due retry by the reconciler, workers live and gone, schedules),
scraped, parsed with prometheus_client's own parsers and checked against direct SQL counts."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from orchestrator import DAG, Orchestrator, Settings, TaskState
from orchestrator.core.protocol import FencingToken
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from orchestrator.core.routing import default_queues
from orchestrator.services.reconciler import ReconcilerService
from orchestrator.store import Store
from orchestrator.store import schema as s
from orchestrator.web.metrics import DURATION_BUCKETS, LAG_BUCKETS, render
from tests.conftest import backend_orchestrator

T = TaskState
NAMES = ["t.ok", "t.fail"]
OPEN = ("PENDING", "READY", "QUEUED", "RUNNING", "RETRYING", "DEAD_LETTER")
FAST = {"base": 0.05, "cap": 0.05, "jitter": "none"}
Samples = dict[str, dict[frozenset[tuple[str, str]], float]]


@pytest.fixture(params=["postgres"])
def orc(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Orchestrator]:
    o = backend_orchestrator(request, str(tmp_path), NAMES)
    assert isinstance(o, Orchestrator)
    yield o
    o.store.dispose()


def scrape(orc: Orchestrator, **kwargs: Any) -> Samples:
    """Every sample of one scrape in the classic text format, parsed by prometheus_client."""
    body, content_type = render(orc, **kwargs)
    assert content_type.startswith("text/plain; version=0.0.4")
    out: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
    return out


def one(samples: Samples, name: str, **labels: str) -> float:
    return samples[name][frozenset(labels.items())]


def by(samples: Samples, name: str, *labels: str) -> dict[tuple[str, ...], float]:
    """A family's samples keyed by the values of ``labels``."""
    out: dict[tuple[str, ...], float] = {}
    for key, value in samples.get(name, {}).items():
        d = dict(key)
        out[tuple(d[label] for label in labels)] = value
    return out


def sql(orc: Orchestrator, text: str, **params: Any) -> list[Any]:
    with orc.store.engine.connect() as conn:
        return list(conn.execute(sa.text(text), params).all())


def task(orc: Orchestrator, run_id: str, key: str) -> Any:
    return orc.store.reads.get_task(run_id, key)


def claim(orc: Orchestrator, run_id: str, key: str, worker: str) -> FencingToken:
    t = task(orc, run_id, key)
    assert t.state is T.QUEUED, (key, t.state)
    token = FencingToken(run_id, key, t.attempt)
    assert orc.claim(token, worker, t.task) is not None
    return token


def build_state(orc: Orchestrator) -> dict[str, str]:
    """Runs in every shape the metrics report; returns their ids by name."""
    store = orc.store
    orc.register_worker("w1@h", default_queues(), 3)
    orc.register_worker("w2@h", default_queues(), 2)
    orc.register_worker("gone@h", default_queues(), 4)
    with store.engine.begin() as conn:  # a worker whose registry heartbeat stopped an hour ago
        conn.execute(
            s.workers.update()
            .where(s.workers.c.name == "gone@h")
            .values(seen_at=dt.datetime.now(dt.UTC) - dt.timedelta(hours=1))
        )
    runs: dict[str, str] = {}

    # acme: a -> (b, c); a succeeds, b runs on w1, c fails once and is retried by the reconciler
    etl = DAG("etl", tenant="acme")
    a = etl.task("a", "t.ok")
    etl.task("b", "t.ok", upstream=[a])
    etl.task("c", "t.fail", upstream=[a], max_attempts=3, backoff=FAST)
    runs["etl"] = orc.submit(etl).id
    assert orc.complete(claim(orc, runs["etl"], "a", "w1@h:11"), "A").accepted
    claim(orc, runs["etl"], "b", "w1@h:12")
    c = claim(orc, runs["etl"], "c", "w2@h:21")
    assert orc.fail_attempt(c, error="boom").state is T.RETRYING

    # globex, high priority: p fails twice the same way (DEAD_LETTER); q runs on w2
    poison = DAG("poison", tenant="globex", priority="high")
    poison.task("p", "t.fail", max_attempts=5, backoff=FAST)
    poison.task("q", "t.ok")
    runs["poison"] = orc.submit(poison).id
    for _ in range(2):
        p = claim(orc, runs["poison"], "p", "w1@h:13")
        orc.fail_attempt(p, error="bad row", fingerprint="same-every-time")
        if task(orc, runs["poison"], "p").state is T.RETRYING:
            time.sleep(0.1)
            orc.reconcile()
    assert task(orc, runs["poison"], "p").state is T.DEAD_LETTER
    claim(orc, runs["poison"], "q", "w2@h:22")

    # finished runs: one SUCCEEDED (acme), one FAILED (globex)
    ok = DAG("ok", tenant="acme")
    ok.task("only", "t.ok")
    runs["ok"] = orc.submit(ok).id
    assert orc.complete(claim(orc, runs["ok"], "only", "w2@h:23"), 1).accepted
    bad = DAG("bad", tenant="globex")
    bad.task("only", "t.fail")
    runs["bad"] = orc.submit(bad).id
    assert orc.fail_attempt(claim(orc, runs["bad"], "only", "w1@h:14"), error="no").state is T.FAILED

    # a lease that expires: the reconciler fails the attempt and closes the run
    lost = DAG("lost", tenant="globex")
    lost.task("x", "t.ok")
    runs["lost"] = orc.submit(lost).id
    x = task(orc, runs["lost"], "x")
    assert store.attempts.claim(runs["lost"], "x", x.attempt, "w1@h:15", 0.01, "t.ok") is not None
    time.sleep(0.1)
    orc.reconcile()  # also releases c's due retry
    assert task(orc, runs["lost"], "x").state is T.FAILED
    assert task(orc, runs["etl"], "c").state in (T.READY, T.QUEUED)

    # a backlog: more low-priority roots than the live workers' window (5 slots x depth 2)
    wide = DAG("wide", tenant="acme", priority="low")
    for i in range(15):
        wide.task(f"n{i}", "t.ok")
    runs["wide"] = orc.submit(wide).id

    # schedules: one overdue by two minutes, one not due yet, one paused (not reported)
    for name, paused in (("late", False), ("early", False), ("sleeping", True)):
        orc.schedules.add(name, every=3600, spec=ok, paused=paused)
    now = dt.datetime.now(dt.UTC)
    with store.engine.begin() as conn:
        for name, at in (("late", now - dt.timedelta(seconds=120)), ("sleeping", now - dt.timedelta(hours=2))):
            conn.execute(s.schedules.update().where(s.schedules.c.name == name).values(next_at=at))
    return runs


def test_metrics_match_the_database(orc: Orchestrator) -> None:
    build_state(orc)
    samples = scrape(orc)
    assert one(samples, "orchestrator_database_up") == 1

    # orchestrator_tasks: exactly the open tasks per (state, queue, tenant)
    expected = {
        (st, q, ten): float(n)
        for st, q, ten, n in sql(
            orc,
            "SELECT state, queue, tenant, count(*) FROM orc_tasks"
            f" WHERE state IN ({', '.join(repr(x) for x in OPEN)}) GROUP BY state, queue, tenant",
        )
    }
    assert by(samples, "orchestrator_tasks", "state", "queue", "tenant") == expected
    states = {st for st, _, _ in expected}
    assert {"READY", "QUEUED", "RUNNING", "DEAD_LETTER"} <= states, states

    # the READY backlog and its oldest task's age, per queue (every consumed queue is reported)
    backlog = {
        q: float(n) for q, n in sql(orc, "SELECT queue, count(*) FROM orc_tasks WHERE state = 'READY' GROUP BY queue")
    }
    reported = by(samples, "orchestrator_ready_backlog", "queue")
    assert {k[0]: v for k, v in reported.items() if v} == backlog and backlog.get("orchestrator.low", 0) > 0
    assert set(default_queues()) <= {k[0] for k in reported}
    ages = by(samples, "orchestrator_ready_oldest_age_seconds", "queue")
    now = dt.datetime.now(dt.UTC)
    for q, oldest in sql(orc, "SELECT queue, min(ready_at) FROM orc_tasks WHERE state = 'READY' GROUP BY queue"):
        if isinstance(oldest, str):  # SQLite
            oldest = dt.datetime.fromisoformat(oldest)
        if oldest.tzinfo is None:
            oldest = oldest.replace(tzinfo=dt.UTC)
        assert abs(ages[(q,)] - (now - oldest).total_seconds()) < 5, (q, ages[(q,)])
    assert all(v == 0 for (q,), v in ages.items() if q not in backlog)

    # dead letters
    (dead,) = sql(orc, "SELECT count(*) FROM orc_tasks WHERE state = 'DEAD_LETTER'")[0]
    assert one(samples, "orchestrator_dead_letters_open") == dead == 1

    # live workers and their free slots: the pool size minus the tasks RUNNING on them
    assert one(samples, "orchestrator_workers_live") == 2
    for name, size in (("w1@h", 3), ("w2@h", 2)):
        (running,) = sql(
            orc, "SELECT count(*) FROM orc_tasks WHERE state = 'RUNNING' AND worker LIKE :w", w=name + ":%"
        )[0]
        assert running >= 1
        assert one(samples, "orchestrator_worker_slots", worker=name) == size
        assert one(samples, "orchestrator_worker_free_slots", worker=name) == size - running
        assert 0 <= one(samples, "orchestrator_worker_heartbeat_age_seconds", worker=name) < 30
    assert "gone@h" not in {dict(k)["worker"] for k in samples["orchestrator_worker_slots"]}

    # schedule lag: the overdue one by ~120 s, the one not due 0, the paused one absent
    lag = by(samples, "orchestrator_schedule_lag_seconds", "schedule", "tenant")
    assert set(lag) == {("late", "acme"), ("early", "acme")}
    assert 115 < lag[("late", "acme")] < 180 and lag[("early", "acme")] == 0

    # attempts that ended, by outcome: the ledger's RUNNING -> X rows
    ended = {
        (to, q, ten): float(n)
        for to, q, ten, n in sql(
            orc,
            "SELECT e.to_state, t.queue, t.tenant, count(*) FROM orc_task_events e"
            " JOIN orc_tasks t ON t.run_id = e.run_id AND t.key = e.key"
            " WHERE e.accepted AND e.from_state = 'RUNNING' GROUP BY e.to_state, t.queue, t.tenant",
        )
    }
    assert by(samples, "orchestrator_attempts_finished", "outcome", "queue", "tenant") == ended
    assert {to for to, _, _ in ended} == {"SUCCEEDED", "RETRYING", "DEAD_LETTER", "FAILED"}

    # dispatch lag: one sample per accepted claim; attempt durations: one per ended attempt
    claims = dict(
        sql(
            orc,
            "SELECT t.queue, count(*) FROM orc_task_events e JOIN orc_tasks t ON t.run_id = e.run_id AND t.key = e.key"
            " WHERE e.accepted AND e.from_state = 'QUEUED' AND e.to_state = 'RUNNING' GROUP BY t.queue",
        )
    )
    lag_counts = by(samples, "orchestrator_dispatch_lag_seconds_gcount", "queue")
    assert lag_counts == {(q,): float(n) for q, n in claims.items()}
    per_queue = {q: sum(n for (_, qq, _), n in ended.items() if qq == q) for q in {q for _, q, _ in ended}}
    assert by(samples, "orchestrator_task_duration_seconds_gcount", "queue") == {(q,): n for q, n in per_queue.items()}
    for name, bounds in (
        ("orchestrator_dispatch_lag_seconds", LAG_BUCKETS),
        ("orchestrator_task_duration_seconds", DURATION_BUCKETS),
    ):
        buckets = by(samples, name + "_bucket", "queue", "le")
        for (q,), count in by(samples, name + "_gcount", "queue").items():
            series = [buckets[(q, le)] for le in [*(repr(float(b)) for b in bounds), "+Inf"]]
            assert series == sorted(series) and series[-1] == count  # cumulative, +Inf is the count
            assert 0 <= one(samples, name + "_gsum", queue=q) < 60 * count

    # runs that ended: by state and tenant, and their durations
    finished = {
        (st, ten): float(n)
        for st, ten, n in sql(
            orc, "SELECT state, tenant, count(*) FROM orc_runs WHERE state <> 'RUNNING' GROUP BY state, tenant"
        )
    }
    assert by(samples, "orchestrator_runs_finished", "state", "tenant") == finished
    assert finished == {("SUCCEEDED", "acme"): 1, ("FAILED", "globex"): 2}
    assert by(samples, "orchestrator_run_duration_seconds_gcount", "tenant") == {("acme",): 1, ("globex",): 2}

    # what the reconciler did, from its ledger rows
    rec = sql(
        orc,
        "SELECT key IS NULL, from_state, to_state, accepted FROM orc_task_events WHERE actor = 'reconciler'",
    )
    actions = by(samples, "orchestrator_reconciler_actions", "action")
    assert actions[("retry_released",)] == sum(1 for r in rec if r[1] == "RETRYING" and r[2] == "READY" and r[3]) == 2
    assert actions[("lease_expired",)] == sum(1 for r in rec if not r[0] and r[1] == "RUNNING" and r[3]) == 1
    assert actions[("run_closed",)] == sum(1 for r in rec if r[0] and r[3]) == 1
    assert sum(actions.values()) == len(rec)

    # the whole window was read
    assert one(samples, "orchestrator_metrics_window_seconds") == 900
    (n_events,) = sql(orc, "SELECT count(*) FROM orc_task_events")[0]
    assert one(samples, "orchestrator_metrics_window_events") == n_events
    assert "orchestrator_reconciler_on_duty" not in samples  # nobody holds the duty
    assert by(samples, "orchestrator_deadline_misses", "scope", "tenant") == {}  # no DAG set a deadline


def test_the_window_is_bounded_and_windowed_values_go_down(orc: Orchestrator) -> None:
    build_state(orc)
    (n_events,) = sql(orc, "SELECT count(*) FROM orc_task_events")[0]
    # at most max_events ledger rows, the newest: the window then covers less than asked
    cut = scrape(orc, max_events=10)
    assert one(cut, "orchestrator_metrics_window_events") == 10 < n_events
    assert one(cut, "orchestrator_metrics_window_seconds") < 900
    # a window that ended before the last event: the windowed gauges fall back to nothing,
    # while the state gauges stay (they are not windowed)
    time.sleep(0.3)
    empty = scrape(orc, window_seconds=0.1)
    assert one(empty, "orchestrator_metrics_window_events") == 0
    assert "orchestrator_dispatch_lag_seconds_gcount" not in empty
    assert "orchestrator_attempts_finished" not in empty
    assert one(empty, "orchestrator_dead_letters_open") == 1
    assert by(empty, "orchestrator_tasks", "state", "queue", "tenant") == by(
        scrape(orc), "orchestrator_tasks", "state", "queue", "tenant"
    )


def test_openmetrics_types_are_gauges_only(orc: Orchestrator) -> None:
    build_state(orc)
    body, content_type = render(orc, accept="application/openmetrics-text; version=1.0.0,text/plain;q=0.5")
    assert content_type.startswith("application/openmetrics-text")
    types = {f.name: f.type for f in openmetrics_families(body.decode())}
    assert types["orchestrator_dispatch_lag_seconds"] == "gaugehistogram"
    assert types["orchestrator_task_duration_seconds"] == "gaugehistogram"
    assert types["orchestrator_run_duration_seconds"] == "gaugehistogram"
    assert set(types.values()) == {"gauge", "gaugehistogram"}, types  # nothing windowed is a counter


def test_a_tenant_bound_orchestrator_sees_its_tenant_only(orc: Orchestrator) -> None:
    build_state(orc)
    bound = Orchestrator(
        orc.settings, store=orc.store, publisher=RecordingPublisher(), registry=StaticRegistry(NAMES), tenant="globex"
    )
    samples = scrape(bound)
    assert {ten for _, _, ten in by(samples, "orchestrator_tasks", "state", "queue", "tenant")} == {"globex"}
    assert {ten for _, _, ten in by(samples, "orchestrator_attempts_finished", "outcome", "queue", "tenant")} == {
        "globex"
    }
    assert by(samples, "orchestrator_runs_finished", "state", "tenant") == {("FAILED", "globex"): 2}
    assert by(samples, "orchestrator_schedule_lag_seconds", "schedule", "tenant") == {}
    assert one(samples, "orchestrator_dead_letters_open") == 1


def test_deadline_misses_are_counted_from_the_ledger(orc: Orchestrator) -> None:
    orc.register_worker("w1@h", default_queues(), 1)
    # a run with a deadline it cannot meet (its task is never claimed), and one without
    late = DAG("late", tenant="acme", deadline=0.05)
    late.task("never", "t.ok")
    late_id = orc.submit(late).id
    free = DAG("free", tenant="globex")
    free.task("never", "t.ok")
    orc.submit(free)
    time.sleep(0.2)
    orc.reconcile()
    samples = scrape(orc)
    misses = sql(
        orc,
        "SELECT run_id, key, actor FROM orc_task_events WHERE kind = 'deadline_missed' AND accepted",
    )
    assert [(m[0], m[1], m[2]) for m in misses] == [(late_id, None, "reconciler")]
    assert by(samples, "orchestrator_deadline_misses", "scope", "tenant") == {("run", "acme"): 1}
    assert one(samples, "orchestrator_reconciler_actions", action="deadline_missed") == 1


def test_the_reconciler_on_duty_is_reported_on_postgres(orc: Orchestrator) -> None:
    service = ReconcilerService(orc.reconciler, name="metrics-test", interval=1.0, stall_seconds=10.0)
    try:
        assert service.step() is not None
        samples = scrape(orc)
        if orc.store.engine.dialect.name == "postgresql":
            assert samples["orchestrator_reconciler_on_duty"] == {frozenset({("reconciler", "metrics-test")}): 1.0}
        else:
            assert "orchestrator_reconciler_on_duty" not in samples
    finally:
        service.release()


def test_a_database_that_cannot_be_read_is_reported_not_raised(tmp_path: Path) -> None:
    url = "postgresql+psycopg://nobody@127.0.0.1:1/none"  # nothing listens there
    settings = Settings.from_env({}, data_dir=str(tmp_path), database_url=url)
    store = Store(url)  # no retries: a scrape must not wait out an outage
    down = Orchestrator(settings, store=store, publisher=RecordingPublisher(), registry=StaticRegistry(NAMES))
    try:
        started = time.monotonic()
        assert scrape(down) == {"orchestrator_database_up": {frozenset(): 0.0}}
        assert time.monotonic() - started < 10
    finally:
        store.dispose()
