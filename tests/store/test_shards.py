"""The reconciler's shards (issue 35): K stored once and each run's shard with it; shards claimed
by compare-and-set, renewed, given back and taken over; and the epoch fence: a deposed owner's
write is refused and recorded (a rejected ledger row naming the stale epoch) while the new
owner's is applied, once.

Time passing is written, not waited for: a lease "runs out" by an UPDATE of its expiry."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from orchestrator import DAG, Orchestrator, Settings, TaskState
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from orchestrator.core.routing import default_queues, route
from orchestrator.services.reconciler import ReconcilerService
from orchestrator.store import Store
from orchestrator.store import schema as s
from orchestrator.store.shards import Fence, Shards, check, shard_of, shard_sql

T = TaskState
K = 8
pytestmark = pytest.mark.postgres


@pytest.fixture
def store(pg_clean: str) -> Iterator[Store]:
    st = Store(pg_clean, dispatch_depth=1)
    st.workers.register("test-worker", default_queues(), 10_000)
    yield st
    st.dispose()


def submit(store: Store, dag: DAG) -> str:
    queues = {n.key: route(dag.tenant, dag.priority_of(n), n.queue) for n in dag.nodes.values()}
    run_id, _ = store.submission.create_run(dag, queues=queues, wants_upstream=lambda name: True)
    return run_id


def one_task(name: str = "one") -> DAG:
    dag = DAG(name)
    dag.task("a", "t", max_attempts=3)
    return dag


def run_out(store: Store, owner: str) -> None:
    """``owner`` stopped renewing long ago: its shards' leases and its heartbeat are over."""
    with store.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE orc_shards SET lease_expires_at = now() - interval '1 second' WHERE owner = :o"),
            {"o": owner},
        )
        conn.execute(
            sa.text("UPDATE orc_reconcilers SET expires_at = now() - interval '1 second' WHERE name = :o"), {"o": owner}
        )


def ledger(store: Store, run_id: str, key: str | None = "a") -> list[tuple[str | None, str, bool, str | None]]:
    with store.engine.connect() as conn:
        rows = conn.execute(
            sa.select(s.events.c.from_state, s.events.c.to_state, s.events.c.accepted, s.events.c.reason)
            .where(s.events.c.run_id == run_id, s.events.c.key.is_(None) if key is None else s.events.c.key == key)
            .order_by(s.events.c.id)
        ).all()
    return [tuple(r) for r in rows]  # type: ignore[misc]


def deposed(store: Store) -> tuple[Fence, Fence]:
    """A held every shard, its leases ran out, B took them all over: both fences, A's stale."""
    shards = Shards(store.db)
    shards.configure(K)
    a = shards.rebalance("a", {}, 30)
    run_out(store, "a")
    b = shards.rebalance("b", {}, 30)
    assert a.held == b.held == list(range(K))
    assert all(b.epochs[i] == a.epochs[i] + 1 for i in range(K))
    return a, b


def test_the_python_shard_and_the_sql_shard_agree(store: Store) -> None:
    ids = [store.db.new_id() for _ in range(300)] + ["", "x", "é"]
    with store.engine.connect() as conn:
        for k in (1, 7, 64):
            got = [conn.execute(sa.select(shard_sql(sa.literal(i, sa.Text), k))).scalar_one() for i in ids]
            assert got == [shard_of(i, k) for i in ids]
    assert len({shard_of(i, 64) for i in ids}) > 50  # spread over the shards


def test_k_is_stored_once_and_new_runs_carry_their_shard(store: Store) -> None:
    before = submit(store, one_task("before"))
    shards = Shards(store.db)
    assert shards.count() is None
    assert shards.configure(K) == K
    assert Shards(store.db).configure(16) == K  # fixed for the deployment's life
    after = submit(store, one_task("after"))
    with store.engine.connect() as conn:
        stored = dict(conn.execute(sa.select(s.runs.c.id, s.runs.c.shard)).all())
        assert conn.execute(sa.select(sa.func.count()).select_from(s.shards)).scalar_one() == K
    assert stored == {before: None, after: shard_of(after, K)}


def test_claim_renew_rebalance_and_take_over(store: Store) -> None:
    shards = Shards(store.db)
    shards.configure(K)
    a = shards.rebalance("a", {}, 30)
    assert a.held == list(range(K)) and set(a.epochs.values()) == {1} and a.leader
    # b joins: nothing is free, so it waits; a gives half back at its next turn, b takes it
    b = shards.rebalance("b", {}, 30)
    assert b.held == []
    a = shards.rebalance("a", a.epochs, 30)
    assert a.held == list(range(K // 2))
    b = shards.rebalance("b", b.epochs, 30)
    assert b.held == list(range(K // 2, K)) and set(b.epochs.values()) == {2}
    assert shards.rebalance("a", a.epochs, 30) == a  # renewed: same shards, same epochs
    # a third instance: ceil(8 / 3) = 3 each at most
    c = shards.rebalance("c", {}, 30)
    a, b = shards.rebalance("a", a.epochs, 30), shards.rebalance("b", b.epochs, 30)
    c = shards.rebalance("c", c.epochs, 30)
    assert sorted(a.held + b.held + c.held) == list(range(K)) and max(len(f.held) for f in (a, b, c)) == 3
    # b is killed: its leases run out and the others take its shards over at a new epoch
    run_out(store, "b")
    a, c = shards.rebalance("a", a.epochs, 30), shards.rebalance("c", c.epochs, 30)
    a = shards.rebalance("a", a.epochs, 30)
    assert sorted(a.held + c.held) == list(range(K)) and len(a.held) == len(c.held) == 4
    assert all(e >= 3 for i, e in {**a.epochs, **c.epochs}.items() if i in b.epochs)
    assert shards.renew("b", b.epochs, 30) == {}  # b, back, finds it lost them
    # c stops: its shards are free at once
    shards.leave("c")
    a = shards.rebalance("a", a.epochs, 30)
    assert a.held == list(range(K))
    _, views, members = shards.status(60)
    assert [v.owner for v in views] == ["a"] * K and [m.name for m in members] == ["a"]


def test_a_shard_being_written_under_is_not_claimed_until_the_write_commits(store: Store) -> None:
    a, _ = deposed(store)  # (b holds all; make b the one writing, a the one claiming)
    shards = Shards(store.db)
    b = shards.rebalance("b", {i: a.epochs[i] + 1 for i in range(K)}, 30)
    run_out(store, "b")
    run_id = submit(store, one_task())
    with store.engine.begin() as conn:
        assert check(conn, b, run_id) is None  # b's write holds its shard FOR SHARE ...
        c = shards.claim("c", K, 30)  # ... so a claim skips it though its lease ran out
        assert shard_of(run_id, K) not in c and len(c) == K - 1
    assert list(shards.claim("c", K, 30)) == [shard_of(run_id, K)]  # after the commit


def test_a_deposed_owner_does_not_release_a_due_retry_and_the_refusal_is_recorded(store: Store) -> None:
    run_id = submit(store, one_task())
    store.admission.admit_ready(100)
    store.attempts.claim(run_id, "a", 1, "w", 30, "t")
    assert store.attempts.fail(run_id, "a", 1, error="E", window=100).state is T.RETRYING
    with store.engine.begin() as conn:
        conn.execute(s.tasks.update().values(not_before=sa.func.now() - sa.text("interval '1 second'")))
    a, b = deposed(store)
    assert store.recovery.release_due_retries(a) == 0
    assert store.reads.get_task(run_id, "a").state is T.RETRYING
    assert store.recovery.release_due_retries(b) == 1
    assert store.recovery.release_due_retries(b) == 0
    moves = [e for e in ledger(store, run_id) if e[:2] == ("RETRYING", "READY")]
    shard = shard_of(run_id, K)
    assert moves == [
        ("RETRYING", "READY", False,
         f"stale shard epoch: shard {shard} epoch 1 read by a; the shard is at epoch 2 held by b"),
        ("RETRYING", "READY", True, "retry due"),
    ]  # fmt: skip


def test_a_deposed_owner_does_not_republish_expire_wake_or_close(store: Store) -> None:
    # a lost dispatch, an expired lease, a wait past its deadline, a run whose counter missed its end
    lost, leased, waiting, done = (submit(store, one_task(n)) for n in ("lost", "leased", "waiting", "done"))
    waits = DAG("waits")
    waits.wait("w", event="never", timeout=3600)
    waiting = submit(store, waits)
    store.admission.admit_ready(100)
    store.attempts.claim(leased, "a", 1, "w", 30, "t")
    store.attempts.claim(done, "a", 1, "w", 30, "t")
    assert store.attempts.succeed(done, "a", 1, None, 100).accepted
    with store.engine.begin() as conn:
        past = sa.func.now() - sa.text("interval '1 hour'")
        conn.execute(s.tasks.update().where(s.tasks.c.run_id == lost).values(dispatched_at=past))
        conn.execute(s.tasks.update().where(s.tasks.c.run_id == leased).values(lease_expires_at=past))
        conn.execute(s.tasks.update().where(s.tasks.c.run_id == waiting).values(wake_at=past))
        conn.execute(s.runs.update().where(s.runs.c.id == done).values(state="RUNNING", finished_at=None))
    a, b = deposed(store)
    rec = store.recovery
    stale = rec.stale_queued(60, fence=a)
    assert [x.run_id for x in stale] == [lost]
    assert rec.redispatch(lost, "a", 1, stale[0].dispatched_at, a) is None
    assert rec.expired_leases(fence=a) == [(leased, "a", 1)]
    assert not rec.lose_lease(leased, "a", 1, 100, a).accepted
    assert store.waits.wake_due(100, a) == 0
    assert rec.finalize_runs(fence=a) == 0
    # the new owner acts, once each
    assert rec.redispatch(lost, "a", 1, stale[0].dispatched_at, b) is not None
    assert rec.lose_lease(leased, "a", 1, 100, b).state is T.RETRYING
    assert store.waits.wake_due(100, b) == 1
    assert rec.finalize_runs(fence=b) == 1
    assert rec.finalize_runs(fence=b) == 0
    refused = {
        (run_id, key): [e for e in ledger(store, run_id, key) if not e[2]]
        for run_id, key in ((lost, "a"), (leased, "a"), (waiting, "w"), (done, None))
    }
    for (run_id, _), rows in refused.items():
        shard = shard_of(run_id, K)
        assert len(rows) == 1, (run_id, rows)
        assert f"stale shard epoch: shard {shard} epoch 1 read by a; the shard is at epoch 2 held by b" in (
            rows[0][3] or ""
        )
    assert store.reads.get_task(waiting, "w").state is T.FAILED
    assert store.reads.get_run(done).state.value == "SUCCEEDED"
    accepted = [e for e in ledger(store, lost) if e[:2] == ("QUEUED", "QUEUED") and e[2]]
    assert len(accepted) == 1


def test_a_fence_selects_only_its_shards(store: Store) -> None:
    ids = [submit(store, one_task(f"r{i}")) for i in range(12)]
    store.admission.admit_ready(100)
    with store.engine.begin() as conn:
        conn.execute(s.tasks.update().values(dispatched_at=sa.func.now() - sa.text("interval '1 hour'")))
    shards = Shards(store.db)
    shards.configure(K)
    a = shards.rebalance("a", {}, 30)
    b = shards.rebalance("b", {}, 30)
    a = shards.rebalance("a", a.epochs, 30)
    b = shards.rebalance("b", b.epochs, 30)
    got_a = {x.run_id for x in store.recovery.stale_queued(60, fence=a)}
    got_b = {x.run_id for x in store.recovery.stale_queued(60, fence=b)}
    assert got_a | got_b == set(ids) and not got_a & got_b
    assert all(a.has(r) for r in got_a) and all(b.has(r) for r in got_b)


@pytest.fixture
def orc(pg_clean: str) -> Iterator[Orchestrator]:
    o = Orchestrator(
        Settings.from_env({}, database_url=pg_clean, reconciler_shards=K, reconciler_shard_lease=30.0),
        publisher=RecordingPublisher(),
        registry=StaticRegistry(["t"]),
    )
    yield o
    o.store.dispose()


def test_services_in_the_sharded_mode_split_the_shards_and_give_them_back(orc: Orchestrator) -> None:
    services = [ReconcilerService(orc.reconciler, name=n, interval=0.1, stall_seconds=10) for n in "abc"]
    try:
        for _ in range(3):
            for svc in services:
                assert svc.step() is not None  # a pass even while it holds nothing (the admission)
        held = [svc.fence.held for svc in services if svc.fence is not None]
        assert sorted(x for h in held for x in h) == list(range(K)) and all(len(h) == 3 or len(h) == 2 for h in held)
        assert all(svc.on_duty for svc in services) and orc.store.reads.reconciler_on_duty() == []
        services[0].release()
        services[1].step()
        services[2].step()
        assert sorted(services[1].fence.held + services[2].fence.held) == list(range(K))  # type: ignore[union-attr]
    finally:
        for svc in services:
            svc.release()
    with orc.store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM orc_shards WHERE owner IS NOT NULL")).scalar_one() == 0


def test_a_deposed_owner_does_not_judge_a_missed_deadline(store: Store) -> None:
    dag = DAG("late", deadline=600)
    dag.task("a", "t")
    queues = {n.key: route(dag.tenant, dag.priority_of(n), n.queue) for n in dag.nodes.values()}
    run_id, _ = store.submission.create_run(
        dag, queues=queues, wants_upstream=lambda name: True, logical_date="2020-01-01T00:00:00Z"
    )
    a, b = deposed(store)
    [due] = store.deadlines.due(100, a)
    assert store.deadlines.due(100, b) == [due]
    assert store.deadlines.record(due, a) is None
    assert store.deadlines.record(due, b) is not None
    assert store.deadlines.record(due, b) is None  # recorded once
    rows = ledger(store, run_id, None)
    refused = [r for r in rows if not r[2]]
    assert len(refused) == 1 and "judging a deadline: stale shard epoch" in (refused[0][3] or "")
    assert len([r for r in rows if r[2] and "deadline missed" in (r[3] or "")]) == 1


def test_orchestrator_shards_shows_owners_epochs_and_lag(orc: Orchestrator, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from orchestrator.cli import app as cli
    from orchestrator.cli import base as cli_base

    monkeypatch.setattr(cli_base, "_ready_store", lambda: orc)
    runner = CliRunner()
    none = runner.invoke(cli.main, ["shards"])
    assert none.exit_code == 0 and none.stdout.startswith("no shard yet")
    assert json.loads(runner.invoke(cli.main, ["shards", "--json"]).stdout)["shards"] is None
    svc = ReconcilerService(orc.reconciler, name="a", interval=0.1, stall_seconds=10)
    try:
        svc.step()
        out = runner.invoke(cli.main, ["shards"])
        assert out.exit_code == 0, out.output
        lines = out.stdout.splitlines()
        assert lines[0].split()[:3] == ["SHARD", "OWNER", "EPOCH"] and len(lines) == 1 + K + 1 + 2
        assert all(line.split()[1:3] == ["a", "1"] for line in lines[1 : K + 1])
        assert lines[K + 3].split()[:4] == ["a", str(K), str(K), "yes"]
        got = json.loads(runner.invoke(cli.main, ["shards", "--json", "--shard", "3"]).stdout)
        assert got["shards"] == K and [r["shard"] for r in got["shard_rows"]] == [3]
        assert got["shard_rows"][0]["owner"] == "a" and got["shard_rows"][0]["lease_left"] > 0
        assert got["owners"][0]["owner"] == "a"
        bad = runner.invoke(cli.main, ["shards", "--shard", str(K)])
        assert bad.exit_code == 2 and f"the deployment has shards 0 to {K - 1}" in bad.output
    finally:
        svc.release()
