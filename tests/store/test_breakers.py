"""Circuit breakers per resource (issue 22), every transition on a real Postgres and the test
kit's virtual clock (breaker windows and open periods are computed with the database's now()):
closed -> open on the trip rule (min calls, min failures, failure rate; only the resource's
failures count), admission holding an open resource's READY tasks while other work runs and no
retry burned, open -> half-open at open_until with leased probe permits, half-open -> closed on
a probe's success and -> open on its failure (twice as long), a probe that outlives its lease
counted as a failure by the reconciler, an operator's forced open / close / disable with
identity in the breakers' ledger, metrics-only, the ramp's waves after closing. The task
outcomes are the production calls a worker makes (claim, then the success server function or
the failure path)."""

from __future__ import annotations

import datetime as dt
import os
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, ValidationError
from orchestrator.core.dag import dag_from_spec
from orchestrator.core.routing import default_queues
from orchestrator.runtime.celery_app import get_app
from orchestrator.store import schema as s
from orchestrator.store.breakers import UnknownBreakerError, parse_open_for
from orchestrator.testing.runner import CONCURRENCY, WORKER, Kit

pytestmark = pytest.mark.postgres

app = get_app()


@app.task(name="brk.call")
def call(i: int = 0) -> int:
    return i


def flat(name: str, n: int, resources: list[str] | None = None, tenant: str = "default", **node: Any) -> DAG:
    dag = DAG(name, tenant=tenant)
    for i in range(n):
        dag.task(f"t{i:03d}", "brk.call", kwargs={"i": i}, resources=resources or [], **node)
    return dag


def admit(kit: Kit) -> list[str]:
    """One admission (the kit's worker alive at the clock's now); the keys it moved to QUEUED."""
    kit.orc.touch_worker(WORKER, default_queues(), CONCURRENCY)
    return [d.key for d in kit.orc.store.admission.admit_ready(1000)]


def why(kit: Kit, run_id: str, key: str) -> str:
    """``orchestrator explain RUN KEY``'s words."""
    (found,) = kit.orc.explain(run_id, key)
    return "; ".join(r.detail for r in found.reasons)


def states(kit: Kit, run_id: str) -> dict[str, str]:
    return {t.key: t.state.value for t in kit.orc.tasks(run_id)}


def count(kit: Kit, run_id: str, state: str) -> int:
    return sum(1 for v in states(kit, run_id).values() if v == state)


def finish(kit: Kit, run_id: str, key: str, *, exc: str | None = None) -> None:
    """What a worker does with a QUEUED task: claim it, then succeed, or fail raising ``exc``."""
    st = kit.orc.store
    attempt = kit.orc.task(run_id, key).attempt
    assert st.attempts.claim(run_id, key, attempt, WORKER, 60.0, "brk.call") is not None
    if exc is None:
        assert st.attempts.succeed(run_id, key, attempt, 1, 1000).accepted
    else:
        names = [exc, "OSError", "Exception"] if exc in ("TimeoutError", "ConnectionError") else [exc, "Exception"]
        assert st.attempts.fail(run_id, key, attempt, error=f"{exc}: down", window=1000, exc_types=names).accepted


def queued(kit: Kit, run_id: str) -> list[str]:
    return sorted(k for k, v in states(kit, run_id).items() if v == "QUEUED")


def breaker_events(kit: Kit, name: str = "stripe") -> list[tuple[str | None, str, str]]:
    return [(e.from_state, e.to_state, e.actor) for e in kit.orc.breakers.events(name)]


def probe_rows(kit: Kit) -> list[Any]:
    with kit.orc.store.engine.connect() as conn:
        return conn.execute(sa.select(s.breaker_probes)).all()


def trip(kit: Kit, run_id: str, n: int = 3) -> None:
    for key in queued(kit, run_id)[:n]:
        finish(kit, run_id, key, exc="TimeoutError")
    assert kit.orc.breakers.get("stripe").state == "open"


def test_resources_are_validated_and_expanded_per_tenant(orchestrator: Kit) -> None:
    kit = orchestrator
    with pytest.raises(ValidationError, match="resource") as err:
        flat("bad", 1, resources=["no spaces"])
    assert err.value.node == "t000"
    with pytest.raises(ValidationError):
        flat("bad", 1, resources=["{other}"])
    spec = flat("spec", 1, resources=["stripe", "erp:{tenant}"], tenant="acme").to_spec()
    assert spec["nodes"][0]["resources"] == ["stripe", "erp:{tenant}"]
    dag = dag_from_spec(spec)
    run = kit.submit(dag)
    with kit.orc.store.engine.connect() as conn:
        got = conn.execute(sa.select(s.tasks.c.resources).where(s.tasks.c.run_id == run.id)).scalar_one()
    assert got == ["stripe", "erp:acme"]
    # no resources: a null column (the hot path's one check)
    plain = kit.submit(flat("plain", 1))
    with kit.orc.store.engine.connect() as conn:
        assert conn.execute(sa.select(s.tasks.c.resources).where(s.tasks.c.run_id == plain.id)).scalar_one() is None
    assert parse_open_for("30s..10m") == (30.0, 600.0) and parse_open_for("45s") == (45.0, 45.0)
    with pytest.raises(ValidationError):
        kit.orc.breakers.set("stripe", open_for="10m..30s")
    with pytest.raises(UnknownBreakerError):
        kit.orc.breakers.open("nothing")


def test_trips_on_the_thresholds_and_holds_the_resources_ready_tasks(orchestrator: Kit) -> None:
    kit, orc = orchestrator, orchestrator.orc
    orc.breakers.set("stripe", window="60s", min_calls=4, min_failures=3, failure_rate=0.5, open_for="30s..2m")
    run = kit.submit(flat("pay", 12, ["stripe"], max_attempts=3))  # the submit admits its tasks
    admit(kit)
    assert len(queued(kit, run.id)) == 12
    keys = queued(kit, run.id)
    # a failure that is not the resource's (a bug in the body) does not count
    finish(kit, run.id, keys[0], exc="ValueError")
    assert orc.breakers.get("stripe").calls == 0
    finish(kit, run.id, keys[1], exc="TimeoutError")
    finish(kit, run.id, keys[2], exc="ConnectionError")
    finish(kit, run.id, keys[3])
    b = orc.breakers.get("stripe")
    assert (b.state, b.calls, b.failures) == ("closed", 3, 2)  # below min_calls and min_failures
    finish(kit, run.id, keys[4])  # 4 calls, 2 failures: min_failures not reached
    assert orc.breakers.get("stripe").state == "closed"
    finish(kit, run.id, keys[5], exc="TimeoutError")  # 5 calls, 3 failures, 60%
    b = orc.breakers.get("stripe")
    assert (b.state, b.calls, b.failures, b.open_for) == ("open", 5, 3, 30.0)
    assert b.open_until is not None and b.holds
    assert breaker_events(kit)[-1] == ("closed", "open", "worker")
    assert "3 of 5 calls failed" in (orc.breakers.events("stripe")[-1].reason or "")
    # open: a new run's stripe tasks stay READY, other work is admitted and runs
    held = kit.submit(flat("pay2", 5, ["stripe"]))
    other = kit.submit(flat("other", 5, ["erp"]))
    plain = kit.submit(flat("plain", 5))
    admit(kit)
    assert count(kit, held.id, "READY") == 5
    assert count(kit, other.id, "QUEUED") == 5 and count(kit, plain.id, "QUEUED") == 5
    # the failed attempts' retries come due: READY again, held, their attempt not burned
    kit.clock.advance(seconds=10)
    kit.reconcile()
    retried = [k for k in (keys[1], keys[2], keys[5]) if orc.task(run.id, k).state.value == "READY"]
    assert retried == [keys[1], keys[2], keys[5]]
    assert all(orc.task(run.id, k).attempt == 2 for k in retried)
    assert kit.publisher is not None
    with orc.store.engine.connect() as conn:
        requeued = conn.execute(
            sa.select(sa.func.count())
            .select_from(s.events)
            .where(s.events.c.run_id == held.id, s.events.c.to_state == "QUEUED")
        ).scalar_one()
    assert requeued == 0  # nothing of the held run was published
    # explain says why
    assert why(kit, held.id, "t000").startswith("held: breaker stripe open until 20")


def test_min_failures_is_an_absolute_count_and_the_window_slides(orchestrator: Kit) -> None:
    kit, orc = orchestrator, orchestrator.orc
    orc.breakers.set("stripe", window="30s", min_calls=1, min_failures=3, failure_rate=0.5)
    run = kit.submit(flat("pay", 6, ["stripe"]))
    admit(kit)
    keys = queued(kit, run.id)
    finish(kit, run.id, keys[0], exc="TimeoutError")
    finish(kit, run.id, keys[1], exc="TimeoutError")
    assert orc.breakers.get("stripe").state == "closed"  # 100% failed, but 2 < min_failures
    kit.clock.advance(seconds=31)  # both slide out of the window
    finish(kit, run.id, keys[2], exc="TimeoutError")
    b = orc.breakers.get("stripe")
    assert (b.state, b.calls, b.failures) == ("closed", 1, 1)
    finish(kit, run.id, keys[3], exc="TimeoutError")
    finish(kit, run.id, keys[4], exc="TimeoutError")
    assert orc.breakers.get("stripe").state == "open"


def test_half_open_hands_out_leased_probes_and_a_probe_success_closes(orchestrator: Kit) -> None:
    kit, orc = orchestrator, orchestrator.orc
    orc.breakers.set("stripe", min_calls=1, min_failures=1, open_for="30s..2m", probes=2, ramp_max=1)
    first = kit.submit(flat("pay", 1, ["stripe"]))
    admit(kit)
    trip(kit, first.id, 1)
    run = kit.submit(flat("pay2", 10, ["stripe"]))
    assert admit(kit) == []
    kit.clock.advance(seconds=29)
    assert admit(kit) == [] and orc.breakers.get("stripe").state == "open"
    kit.clock.advance(seconds=2)
    probes = admit(kit)  # open_until passed: half-open, two probe permits
    b = orc.breakers.get("stripe")
    assert len(probes) == 2 and (b.state, b.probes_left) == ("half_open", 0)
    assert breaker_events(kit)[-1] == ("open", "half_open", "dispatcher")
    assert sorted((p.run_id, p.key) for p in probe_rows(kit)) == sorted((run.id, k) for k in probes)
    assert admit(kit) == []  # no permit left
    assert "half-open" in why(kit, run.id, queued_not(kit, run.id, probes)[0])
    finish(kit, run.id, probes[0])
    b = orc.breakers.get("stripe")
    assert (b.state, b.wave, b.reopens, b.open_for) == ("closed", None, 0, None)
    assert breaker_events(kit)[-1] == ("half_open", "closed", "worker")
    assert probe_rows(kit) == []
    assert len(admit(kit)) == 8  # ramp_max 1: no ramp, the backlog goes


def queued_not(kit: Kit, run_id: str, keys: list[str]) -> list[str]:
    return sorted(k for k, v in states(kit, run_id).items() if v == "READY" and k not in keys)


def test_a_probe_failure_reopens_for_twice_as_long_up_to_the_most(orchestrator: Kit) -> None:
    kit, orc = orchestrator, orchestrator.orc
    orc.breakers.set("stripe", min_calls=1, min_failures=1, open_for="30s..50s", probes=1)
    run = kit.submit(flat("pay", 1, ["stripe"]))
    admit(kit)
    trip(kit, run.id, 1)
    late = kit.submit(flat("pay2", 4, ["stripe"]))
    for expected in (60.0, 50.0):  # doubled, then capped at open_max
        kit.clock.advance(seconds=orc.breakers.get("stripe").open_for + 1)
        probe = admit(kit)
        assert len(probe) == 1
        finish(kit, late.id, probe[0], exc="ConnectionError")
        b = orc.breakers.get("stripe")
        assert (b.state, b.open_for) == ("open", min(expected, 50.0))
        assert breaker_events(kit)[-1] == ("half_open", "open", "worker")
    assert orc.breakers.get("stripe").reopens == 2


def test_a_probe_that_outlives_its_lease_counts_as_a_failure(orchestrator: Kit) -> None:
    kit, orc = orchestrator, orchestrator.orc
    orc.breakers.set("stripe", min_calls=1, min_failures=1, open_for="30s..10m", probes=1, probe_lease="20s")
    run = kit.submit(flat("pay", 1, ["stripe"]))
    admit(kit)
    trip(kit, run.id, 1)
    late = kit.submit(flat("pay2", 3, ["stripe"]))
    kit.clock.advance(seconds=31)
    kit.reconcile()  # the reconciler's pass: half-open, and its admission hands out the probe
    assert orc.breakers.get("stripe").state == "half_open" and len(probe_rows(kit)) == 1
    (probe,) = queued(kit, late.id)
    st = orc.store
    assert st.attempts.claim(late.id, probe, 1, WORKER, 600.0, "brk.call") is not None  # it hangs
    kit.clock.advance(seconds=21)
    report = kit.reconcile()
    b = orc.breakers.get("stripe")
    assert (b.state, b.open_for) == ("open", 60.0) and report["breaker_changes"] >= 1
    events = orc.breakers.events("stripe")
    assert (events[-1].to_state, events[-1].actor) == ("open", "reconciler")
    assert "outlived its lease" in (events[-1].reason or "")
    assert probe_rows(kit) == []
    # the hung probe's late success is a call, not a probe: it does not close the breaker
    assert st.attempts.succeed(late.id, probe, 1, 1, 1000).accepted
    assert orc.breakers.get("stripe").state == "open"


def test_after_closing_admission_ramps_up_in_waves(orchestrator: Kit) -> None:
    kit, orc = orchestrator, orchestrator.orc
    orc.breakers.set("stripe", min_calls=1, min_failures=1, open_for="30s", probes=1, ramp_max=4)
    run = kit.submit(flat("pay", 1, ["stripe"]))
    admit(kit)
    trip(kit, run.id, 1)
    backlog = kit.submit(flat("pay2", 30, ["stripe"]))
    kit.clock.advance(seconds=31)
    (probe,) = admit(kit)
    finish(kit, backlog.id, probe)
    waves = []
    for _ in range(4):
        got = admit(kit)
        waves.append(len(got))
        assert admit(kit) == []  # the wave is full until it came back
        for key in got:
            finish(kit, backlog.id, key)
    assert waves == [1, 2, 4, 22]  # past ramp_max the rest goes at once
    assert orc.breakers.get("stripe").wave is None


def test_a_failure_in_the_ramp_starts_it_again(orchestrator: Kit) -> None:
    kit, orc = orchestrator, orchestrator.orc
    orc.breakers.set("stripe", min_calls=50, min_failures=50, open_for="30s", ramp_max=8)
    orc.breakers.open("stripe")
    run = kit.submit(flat("pay", 20, ["stripe"], max_attempts=3))
    # an operator's close releases at once (no ramp); a probe's success ramps: set it up by hand
    with orc.store.engine.begin() as conn:
        conn.execute(s.breakers.update().values(state="closed", forced=False, wave=2, wave_admitted=0, wave_done=0))
    got = admit(kit)
    assert len(got) == 2
    finish(kit, run.id, got[0], exc="TimeoutError")
    assert orc.breakers.get("stripe").wave == 1


def test_an_operator_forces_open_closes_and_disables_with_identity(orchestrator: Kit) -> None:
    kit, orc = orchestrator, orchestrator.orc
    orc.breakers.set("stripe", min_calls=1, min_failures=1, by="alice")
    b = orc.breakers.open("stripe", by="alice", reason="stripe status page: outage")
    assert (b.state, b.forced, b.open_until) == ("open", True, None)
    run = kit.submit(flat("pay", 3, ["stripe"]))
    kit.clock.advance(hours=2)  # forced: no open_until, no half-open
    assert admit(kit) == [] and orc.breakers.get("stripe").state == "open"
    assert "open until an operator closes it" in why(kit, run.id, "t000")
    orc.breakers.close("stripe", by="bob")  # admits the held tasks at once
    assert len(queued(kit, run.id)) == 3
    for key in queued(kit, run.id)[:2]:
        finish(kit, run.id, key, exc="TimeoutError")
    orc.breakers.disable("stripe", by="carol")
    assert orc.breakers.get("stripe").state == "closed"
    events = orc.breakers.events("stripe")
    assert [(e.from_state, e.to_state, e.actor, e.by) for e in events] == [
        (None, "closed", "operator", "alice"),
        ("closed", "open", "operator", "alice"),
        ("open", "closed", "operator", "bob"),
        ("closed", "open", "worker", None),
        ("open", "closed", "operator", "carol"),
    ]
    # disabled: counts nothing, never trips
    more = kit.submit(flat("pay2", 3, ["stripe"]))
    assert len(queued(kit, more.id)) == 3
    for key in queued(kit, more.id):
        finish(kit, more.id, key, exc="TimeoutError")
    b = orc.breakers.get("stripe")
    assert (b.mode, b.state, b.calls) == ("disabled", "closed", 0)


def test_metrics_only_counts_and_never_holds(orchestrator: Kit) -> None:
    kit, orc = orchestrator, orchestrator.orc
    orc.breakers.set("stripe", min_calls=1, min_failures=1, mode="metrics")
    run = kit.submit(flat("pay", 6, ["stripe"], max_attempts=1))
    admit(kit)
    for key in queued(kit, run.id)[:3]:
        finish(kit, run.id, key, exc="TimeoutError")
    b = orc.breakers.get("stripe")
    assert (b.state, b.calls, b.failures, b.holds) == ("closed", 3, 3, False)
    more = kit.submit(flat("pay2", 2, ["stripe"]))
    assert count(kit, more.id, "QUEUED") == 2


def test_state_changes_are_alerted_once_by_the_reconciler(orchestrator: Kit) -> None:
    from orchestrator.services import alerts

    kit, orc = orchestrator, orchestrator.orc
    got: list[dict[str, Any]] = []

    def receive(sender: Any, alert: dict[str, Any], **_: Any) -> None:
        got.append(alert)

    alerts.breaker_changed.connect(receive)
    try:
        orc.breakers.set("stripe", min_calls=1, min_failures=1)
        run = kit.submit(flat("pay", 1, ["stripe"]))
        admit(kit)
        trip(kit, run.id, 1)
        kit.reconcile()
        kit.reconcile()
    finally:
        alerts.breaker_changed.disconnect(receive)
    assert [(a["breaker"], a["from_state"], a["state"]) for a in got] == [("stripe", "closed", "open")]
    assert got[0]["event"] == "breaker_changed" and dt.datetime.fromisoformat(got[0]["at"])


def test_a_maps_children_use_its_resources(orchestrator: Kit) -> None:
    kit, orc = orchestrator, orchestrator.orc
    orc.breakers.set("erp:acme", min_calls=1, min_failures=1)
    orc.breakers.open("erp:acme")
    dag = DAG("mapped", tenant="acme")
    dag.map("m", "brk.call", over=[1, 2, 3], kwarg="i", resources=["erp:{tenant}"])
    run = kit.submit(dag)
    admit(kit)
    kids = {k: v for k, v in states(kit, run.id).items() if k.startswith("m[")}
    assert sorted(kids.values()) == ["READY"] * 3
    with orc.store.engine.connect() as conn:
        got = conn.execute(
            sa.select(s.tasks.c.resources).where(s.tasks.c.run_id == run.id, s.tasks.c.map_parent == "m")
        ).scalars()
        assert list(got) == [["erp:acme"]] * 3
    orc.breakers.close("erp:acme")
    assert sorted(v for k, v in states(kit, run.id).items() if k.startswith("m[")) == ["QUEUED"] * 3


def test_the_cli_sets_shows_and_acts_with_identity(orchestrator: Kit, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from click.testing import CliRunner

    from orchestrator.cli import app as cli
    from orchestrator.cli import base as cli_base

    kit = orchestrator
    monkeypatch.setattr(cli_base, "_ready_store", lambda: kit.orc)
    runner = CliRunner()
    out = runner.invoke(
        cli.main,
        ["breaker", "set", "stripe", "--window", "2m", "--min-calls", "10", "--failure-rate", "0.25",
         "--min-failures", "3", "--open-for", "30s..10m", "--probes", "2", "--failure-on", "CardDeclined"],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    assert out.output.startswith("stripe  closed  no calls in 120s  trips at >= 10 calls, >= 3 failures, >= 0.25")
    out = runner.invoke(cli.main, ["breaker", "open", "stripe", "--reason", "outage"])
    assert out.exit_code == 0 and "open until an operator closes it" in out.output
    out = runner.invoke(cli.main, ["breaker", "show", "stripe", "--json"])
    shown = json.loads(out.output)
    assert (shown["state"], shown["forced"], shown["probes"], shown["failure_on"]) == (
        "open",
        True,
        2,
        ["CardDeclined"],
    )
    assert shown["events"][-1]["reason"] == "outage" and "(cli)" in shown["events"][-1]["by"]
    assert runner.invoke(cli.main, ["breaker", "close", "stripe"]).exit_code == 0
    assert runner.invoke(cli.main, ["breaker", "disable", "stripe"]).exit_code == 0
    listed = json.loads(runner.invoke(cli.main, ["breaker", "list", "--json"]).output)["breakers"]
    assert [(b["name"], b["mode"], b["state"]) for b in listed] == [("stripe", "disabled", "closed")]
    assert runner.invoke(cli.main, ["breaker", "set", "stripe", "--metrics-only"]).exit_code == 0
    assert kit.orc.breakers.get("stripe").mode == "metrics"
    missing = runner.invoke(cli.main, ["breaker", "open", "nope"])
    assert missing.exit_code != 0 and "no breaker named 'nope'" in missing.output
    assert runner.invoke(cli.main, ["breaker", "remove", "stripe"]).exit_code == 0
    assert kit.orc.breakers.all() == []


def test_breaker_errors_exit_2_as_documented(orchestrator: Kit, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every breaker command's error is one ``error: ...`` line and exit 2 (issue 36: 1 before)."""
    from click.testing import CliRunner

    from orchestrator.cli import app as cli
    from orchestrator.cli import base as cli_base

    monkeypatch.setattr(cli_base, "_ready_store", lambda: orchestrator.orc)
    runner = CliRunner()
    for args in (["open", "nope"], ["close", "nope"], ["disable", "nope"], ["remove", "nope"], ["show", "nope"]):
        out = runner.invoke(cli.main, ["breaker", *args])
        assert (out.exit_code, out.stderr) == (2, "error: no breaker named 'nope' (orchestrator breaker set nope)\n"), (
            args,
            out.output,
        )


def test_a_tenant_bound_caller_is_refused_the_deployments_breakers(
    orchestrator: Kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Breakers are deployment-wide (one breaker per resource counts and holds every tenant's
    tasks, and its ledger names the operators who changed it), so a caller bound to a tenant
    (``orchestrator --tenant acme breaker ...``, ``Orchestrator(tenant=...)``) is refused every
    read and action with one clear error, as the metrics of a bound caller leave them out; its
    own tasks' holds stay visible in ``explain``. Nothing is written."""
    from click.testing import CliRunner

    from orchestrator import Orchestrator
    from orchestrator.cli import app as cli
    from orchestrator.cli import base as cli_base

    kit = orchestrator
    kit.orc.breakers.set("stripe", min_calls=1, min_failures=1, by="alice")
    kit.orc.breakers.open("stripe", by="alice", reason="outage")
    run = kit.submit(flat("pay", 1, ["stripe"], tenant="acme"))
    before = breaker_events(kit)

    def bound(tenant: str | None) -> Orchestrator:
        o = kit.orc
        return Orchestrator(o.settings, store=o.store, publisher=o.publisher, registry=o.registry, tenant=tenant)

    acme = bound("acme")
    refused = "breakers are deployment-wide: this orchestrator acts as tenant 'acme'"
    for name, call in {
        "list": acme.breakers.all,
        "show": lambda: acme.breakers.get("stripe"),
        "events": lambda: acme.breakers.events("stripe"),
        "all events": acme.breakers.events,
        "set": lambda: acme.breakers.set("stripe"),
        "open": lambda: acme.breakers.open("stripe"),
        "close": lambda: acme.breakers.close("stripe"),
        "disable": lambda: acme.breakers.disable("stripe"),
        "remove": lambda: acme.breakers.remove("stripe"),
    }.items():
        with pytest.raises(ValidationError, match=refused):
            call()
        assert breaker_events(kit) == before, name
    assert "held: breaker stripe open until an operator closes it" in "; ".join(
        r.detail for r in acme.explain(run.id, "t000")[0].reasons
    )
    # the command line: --tenant before the command (or ORCHESTRATOR_TENANT) binds it
    monkeypatch.setenv("ORCHESTRATOR_TENANT", "")
    monkeypatch.setattr(cli_base, "_ready_store", lambda: bound(os.environ.get("ORCHESTRATOR_TENANT") or None))
    runner = CliRunner()
    for args in (["list"], ["list", "--json"], ["show", "stripe"], ["open", "stripe"], ["remove", "stripe"]):
        out = runner.invoke(cli.main, ["--tenant", "acme", "breaker", *args])
        assert out.exit_code == 2 and out.stderr.startswith(f"error: {refused}"), (args, out.output)
        assert out.stdout == "" and "alice" not in out.output, (args, out.output)
    assert breaker_events(kit) == before
    # the deployment's operator (no tenant) still sees and acts
    monkeypatch.setenv("ORCHESTRATOR_TENANT", "")
    listed = runner.invoke(cli.main, ["breaker", "list"])
    assert listed.exit_code == 0 and listed.output.startswith("stripe  open"), listed.output


def test_the_metrics_show_each_breakers_state_and_changes(orchestrator: Kit) -> None:
    from orchestrator.web.metrics import families

    kit, orc = orchestrator, orchestrator.orc
    orc.breakers.set("stripe", min_calls=1, min_failures=1)
    run = kit.submit(flat("pay", 2, ["stripe"]))
    admit(kit)
    trip(kit, run.id, 1)
    samples = {
        (s_.name, tuple(sorted(s_.labels.items()))): s_.value
        for fam in families(orc.metrics_snapshot(window_seconds=300, max_events=1000))
        for s_ in fam.samples
        if s_.name.startswith("orchestrator_breaker")
    }
    assert samples[("orchestrator_breaker_state", (("breaker", "stripe"), ("mode", "on"), ("state", "open")))] == 1
    assert samples[("orchestrator_breaker_state", (("breaker", "stripe"), ("mode", "on"), ("state", "closed")))] == 0
    assert samples[("orchestrator_breaker_failures", (("breaker", "stripe"),))] == 1
    assert samples[("orchestrator_breaker_transitions", (("breaker", "stripe"), ("to_state", "open")))] == 1
