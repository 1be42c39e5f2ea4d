"""Issue 36, crossings 4 and 8: one tenant cannot slow another's emit, a ``match`` is bounded, an
event id reused with another key or payload is a conflict, and hand-built wait and sensor specs
are checked at submit.

* The event locks are per tenant: while a transaction of ``acme`` holds every one of its event
  locks (a submit that begins thousands of waits, an emit matching slowly), an emit of ``bravo``
  goes through at once, and one of ``acme`` waits (as the database says: a backend waiting on an
  advisory lock).
* A match above ``MAX_MATCH_ITEMS`` elements in an array or ``MAX_MATCH_BYTES`` of JSON is
  refused (``ValidationError`` naming the node) by ``DAG.wait``, the spec format, a hand-built
  ``WaitSpec`` at submit, ``Defer`` and an event trigger; nothing is written.
* An emit's statements are bounded (``ORCHESTRATOR_EMIT_TIMEOUT_SECONDS``): past it,
  ``EmitTimeout`` and nothing written.
* ``event_id`` reused: the same key, payload and run is a duplicate; anything else is
  ``EventIdConflict`` (Python, ``orchestrator emit`` / ``signal`` exit 2, HTTP 409)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from orchestrator import DAG, Defer, EmitTimeout, EventIdConflict, Orchestrator, SensorSpec, ValidationError, WaitSpec
from orchestrator.cli import app as cli
from orchestrator.cli import base as cli_base
from orchestrator.core.dag import dag_from_spec
from orchestrator.core.waits import MAX_MATCH_BYTES, MAX_MATCH_ITEMS, WAIT_TASK, sensor_from_spec
from orchestrator.services.triggers import TriggerError
from orchestrator.store import schema as s
from tests.store.dynamic import orchestrator

pytestmark = pytest.mark.postgres


@pytest.fixture
def orc(pg_clean: str) -> Iterator[Orchestrator]:
    o = orchestrator(pg_clean)
    yield o
    o.store.attempts.hot.close()
    o.store.dispose()


def gate(name: str = "gate", match: dict[str, Any] | None = None) -> DAG:
    dag = DAG(name)
    dag.wait("go", event="go", match=match)
    dag.task("after", "t", upstream=["go"])
    return dag


def count(orc: Orchestrator, table: sa.Table) -> int:
    with orc.store.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


class Holder:
    """A transaction of ``tenant`` that holds the event locks of ``keys`` until released."""

    def __init__(self, orc: Orchestrator, tenant: str, keys: list[str]) -> None:
        self.conn = orc.store.engine.connect()
        self.tx = self.conn.begin()
        self.conn.execute(
            sa.text("SELECT count(orc_event_lock_v1(:tenant, k)) FROM unnest(CAST(:keys AS text[])) AS k"),
            {"tenant": tenant, "keys": keys},
        )

    def release(self) -> None:
        if self.tx.is_active:
            self.tx.rollback()
        self.conn.close()


def in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        began = time.monotonic()
        try:
            out["value"] = fn()
        except Exception as exc:  # noqa: BLE001 (handed to the test)
            out["error"] = exc
        out["seconds"] = time.monotonic() - began

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def waiting_on_a_lock(orc: Orchestrator, deadline: float = 20.0) -> bool:
    """Whether (within ``deadline`` s) some backend runs an emit and waits on an advisory lock."""
    query = sa.text(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND wait_event = 'advisory'"
        " AND query LIKE '%orc_emit_v1%' AND datname = current_database()"
    )
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        with orc.store.engine.connect() as conn:
            if conn.execute(query).scalar_one():
                return True
        time.sleep(0.05)
    return False


#: enough keys that their locks cover every bucket, as a submit beginning thousands of waits does
MANY_KEYS = [f"k{i}" for i in range(3000)]


def test_another_tenants_emit_does_not_wait_on_a_tenants_event_locks(orc: Orchestrator) -> None:
    mine, theirs = orc.submit(gate(), tenant="acme"), orc.submit(gate(), tenant="bravo")
    holder = Holder(orc, "acme", [*MANY_KEYS, "go"])
    try:
        thread, out = in_thread(lambda: orc.events.emit("go", {"n": 1}, tenant="bravo"))
        thread.join(10)
        assert not thread.is_alive(), "bravo's emit waited on acme's event locks"
        assert "error" not in out, out
        assert out["value"].woken == 1 and out["seconds"] < 2.0, out
        # acme's own emit of a key whose lock it holds waits for it (the lock still serialises
        # an emit and a wait of one tenant)
        waiter, got = in_thread(lambda: orc.events.emit("go", {"n": 1}, tenant="acme"))
        assert waiting_on_a_lock(orc)
        assert waiter.is_alive()
    finally:
        holder.release()
    waiter.join(30)
    assert "error" not in got and got["value"].woken == 1, got
    assert orc.task(mine.id, "go").state.value == "SUCCEEDED"
    assert orc.task(theirs.id, "go").state.value == "SUCCEEDED"


def test_an_emit_past_its_statement_bound_is_rolled_back(pg_clean: str) -> None:
    orc = orchestrator(pg_clean, emit_timeout_seconds=0.3)
    try:
        run = orc.submit(gate(), tenant="acme")
        events = count(orc, s.emitted)
        holder = Holder(orc, "acme", ["go"])
        try:
            with pytest.raises(EmitTimeout, match="ORCHESTRATOR_EMIT_TIMEOUT_SECONDS"):
                orc.events.emit("go", {"n": 1}, tenant="acme", event_id="e1")
        finally:
            holder.release()
        assert count(orc, s.emitted) == events and orc.task(run.id, "go").state.value == "WAITING"
        assert orc.events.emit("go", {"n": 1}, tenant="acme", event_id="e1").woken == 1  # once the lock is free
    finally:
        orc.store.attempts.hot.close()
        orc.store.dispose()


def test_a_match_beyond_its_bounds_is_refused_and_nothing_is_written(orc: Orchestrator) -> None:
    wide = {"ids": list(range(MAX_MATCH_ITEMS + 1))}
    big = {"note": "x" * MAX_MATCH_BYTES}
    for match, said in ((wide, f"at most {MAX_MATCH_ITEMS}"), (big, f"at most {MAX_MATCH_BYTES}")):
        with pytest.raises(ValidationError, match=said) as refused:
            DAG("d").wait("w", event="go", match=match)
        assert refused.value.node == "w"
        spec = {"name": "d", "nodes": [{"key": "w", "wait": {"event": "go", "match": match}}]}
        with pytest.raises(ValidationError, match=said) as refused:
            dag_from_spec(spec)
        assert refused.value.node == "w"
        # a hand-built WaitSpec is checked at submit
        dag = DAG("hand")
        dag.task("w", WAIT_TASK, wait=WaitSpec(kind="event", event="go", match=match))
        with pytest.raises(ValidationError, match=said) as refused:
            orc.submit(dag)
        assert refused.value.node == "w" and refused.value.dag == "hand"
        with pytest.raises(ValidationError, match=said):
            Defer(event="go", match=match).spec()
        with pytest.raises(TriggerError, match=said):
            orc.triggers.add("t", event="go", match=match, spec=gate())
    assert count(orc, s.runs) == 0 and count(orc, s.triggers) == 0
    # within the bounds: accepted
    edge = {"ids": list(range(MAX_MATCH_ITEMS))}
    run = orc.submit(gate(match=edge))
    assert orc.events.emit("go", {"ids": list(range(100))}).woken == 1
    assert orc.task(run.id, "go").state.value == "SUCCEEDED"


def test_hand_built_wait_and_sensor_specs_are_checked_at_submit(orc: Orchestrator) -> None:
    bad_waits = [
        WaitSpec(kind="nap", delay=5),
        WaitSpec(kind="event"),  # no event key
        WaitSpec(kind="sleep", event="go", delay=1),
        WaitSpec(kind="sleep", delay=float("nan")),
        WaitSpec(kind="event", event="bad key!"),
        WaitSpec(kind="sleep", until="2030-01-01T00:00:00+00:00", at="09:30", tz="UTC"),
        WaitSpec(kind="event", event="go", timeout=None, on_timeout="explode"),  # type: ignore[arg-type]
        WaitSpec(kind="event", event="go", match=[1, 2]),  # type: ignore[arg-type]
    ]
    for n, spec in enumerate(bad_waits):
        dag = DAG(f"w{n}")
        dag.task("w", WAIT_TASK, wait=spec)
        with pytest.raises(ValidationError) as refused:
            orc.submit(dag)
        assert refused.value.node == "w", (spec, refused.value)
    bad_sensors = [
        SensorSpec(every=None),  # type: ignore[arg-type]
        SensorSpec(every=-1.0),
        SensorSpec(every=5.0, backoff=0.5),
        SensorSpec(every=5.0, max_every=1.0),
        SensorSpec(every="5"),  # type: ignore[arg-type]
    ]
    for n, sensor in enumerate(bad_sensors):
        dag = DAG(f"s{n}")
        dag.task("s", "t", sensor=sensor)
        with pytest.raises(ValidationError) as refused:
            orc.submit(dag)
        assert refused.value.node == "s", (sensor, refused.value)
    with pytest.raises(ValidationError, match="every"):
        sensor_from_spec({"every": None}, ("d", "s"))
    assert count(orc, s.runs) == 0
    # hand-built and well-formed: accepted as DAG.wait / DAG.sensor build them
    dag = DAG("fine")
    dag.task("w", WAIT_TASK, wait=WaitSpec(kind="event", event="go", match={"n": 1}))
    dag.task("s", "t", sensor=SensorSpec(every=5.0))
    assert orc.submit(dag).id


def test_an_event_id_reused_with_another_key_payload_or_run_is_a_conflict(orc: Orchestrator) -> None:
    run = orc.submit(gate())
    first = orc.events.emit("go", {"n": 1, "m": [1, 2]}, event_id="e1")
    assert first.woken == 1 and not first.duplicate
    same = orc.events.emit("go", {"m": [1, 2], "n": 1}, event_id="e1")  # the same JSON: a duplicate
    assert same.duplicate and same.id == first.id and same.woken == 0
    other = orc.submit(gate("other", match={"n": 1, "m": [1, 2], "x": 1}))  # not woken by e1's lookback
    events = count(orc, s.emitted)
    for key, payload, said in (("go", {"n": 2}, "another payload"), ("stop", {"n": 1, "m": [1, 2]}, "key 'go'")):
        with pytest.raises(EventIdConflict, match="event id 'e1' of tenant 'default' was emitted before") as refused:
            orc.events.emit(key, payload, event_id="e1")
        assert said in str(refused.value) and refused.value.id == first.id
    with pytest.raises(EventIdConflict, match=r"as an event \(to no run\), not a signal to run"):
        orc.events.signal(other.id, "go", {"n": 1, "m": [1, 2], "x": 1}, event_id="e1")
    assert count(orc, s.emitted) == events and orc.task(other.id, "go").state.value == "WAITING"
    # another tenant's id space is its own
    assert not orc.events.emit("go", {"n": 9}, event_id="e1", tenant="bravo").duplicate
    assert orc.task(run.id, "go").state.value == "SUCCEEDED"


def test_cli_emit_and_signal_refuse_a_reused_event_id(orc: Orchestrator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_base, "_ready_store", lambda: orc)
    runner = CliRunner()
    run = orc.submit(gate())
    ok = runner.invoke(cli.main, ["emit", "go", "--payload", '{"n": 1}', "--event-id", "e1"])
    assert ok.exit_code == 0, ok.output
    again = runner.invoke(cli.main, ["emit", "go", "--payload", '{"n": 1}', "--event-id", "e1"])
    assert again.exit_code == 0 and "duplicate" in again.stdout
    for args in (
        ["emit", "go", "--payload", '{"n": 2}', "--event-id", "e1"],
        ["signal", run.id, "go", "--payload", '{"n": 1}', "--event-id", "e1"],
    ):
        refused = runner.invoke(cli.main, args)
        assert refused.exit_code == 2, (args, refused.output)
        assert refused.stderr.startswith("error: event id 'e1' of tenant 'default' was emitted before")
        assert len(refused.stderr.splitlines()) == 1


def test_post_api_events_answers_409_for_a_reused_event_id() -> None:
    from tests.unit.test_web import ACME_TOKEN, TENANTS_AUTH, WebCase, bearer

    class Case(WebCase):
        auth = TENANTS_AUTH
        bind = "0.0.0.0"

        def runTest(self) -> None:  # noqa: N802 (unittest)
            waits = DAG("waits")
            waits.wait("go", event="go")
            self.orc.submit(waits, tenant="acme")

            def emit(doc: dict[str, Any]) -> Any:
                return self.fetch(
                    "/api/events", method="POST", body=json.dumps(doc),
                    headers=self._headers({"Content-Type": "application/json", **bearer(ACME_TOKEN)}, True),
                )  # fmt: skip

            assert emit({"key": "go", "payload": {"n": 1}, "event_id": "e1"}).code == 200
            twice = emit({"key": "go", "payload": {"n": 1}, "event_id": "e1"})
            assert twice.code == 200 and json.loads(twice.body)["duplicate"] is True
            refused = emit({"key": "go", "payload": {"n": 2}, "event_id": "e1"})
            assert refused.code == 409, refused.body
            assert "event id 'e1'" in json.loads(refused.body)["error"]

    case = Case()
    case.setUp()
    try:
        case.runTest()
    finally:
        case.tearDown()
