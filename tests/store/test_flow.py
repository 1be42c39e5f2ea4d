"""Keyed flow control on one database (issue 34): ``submit(..., concurrency_key=...)`` with each
``on_busy`` policy, ``throttle``, ``debounce`` with ``max_wait``; every hold, release, skip, merge
and replacement read back from the run-level ledger (``orc_task_events``, ``key`` null); the
refusals (``FlowControlError``) before anything is written; keys per tenant."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from orchestrator import DAG, Orchestrator
from orchestrator.cli import app as cli
from orchestrator.cli import base as cli_base
from orchestrator.core.flow import FlowControlError
from orchestrator.engine.flow import release
from orchestrator.store import schema as s
from tests.store.dynamic import drive, orchestrator

pytestmark = pytest.mark.postgres


@pytest.fixture
def orc(pg_clean: str) -> Iterator[Orchestrator]:
    o = orchestrator(pg_clean)
    yield o
    o.store.attempts.hot.close()
    o.store.dispose()


def pipeline(name: str = "sync", tenant: str | None = None) -> DAG:
    dag = DAG(name, **({"tenant": tenant} if tenant else {}))
    dag.task("extract", "t")
    dag.task("load", "t", upstream=["extract"])
    return dag


def run(orc: Orchestrator, run_id: str) -> Any:
    with orc.store.engine.connect() as conn:
        return conn.execute(sa.select(s.runs).where(s.runs.c.id == run_id)).one()


def ledger(orc: Orchestrator, run_id: str) -> list[tuple[str | None, str, str | None]]:
    """The run-level rows of ``run_id``: (kind, to_state, reason), oldest first."""
    e = s.events.c
    with orc.store.engine.connect() as conn:
        rows = conn.execute(
            sa.select(e.kind, e.to_state, e.reason).where(e.run_id == run_id, e.key.is_(None)).order_by(e.id)
        ).all()
    return [tuple(r) for r in rows]  # type: ignore[misc]


def task_states(orc: Orchestrator, run_id: str) -> set[str]:
    return {t.state.value for t in orc.tasks(run_id)}


def test_a_free_key_admits_and_a_busy_key_queues_until_it_frees(orc: Orchestrator) -> None:
    first = orc.submit(pipeline(), concurrency_key="customer:42")
    assert run(orc, first.id).held is None and task_states(orc, first.id) != {"PENDING"}
    second = orc.submit(pipeline(), concurrency_key="customer:42", max_concurrent=1)
    row = run(orc, second.id)
    assert (row.held, row.flow_key, row.state) == ("concurrency", "customer:42", "RUNNING")
    assert task_states(orc, second.id) == {"PENDING"}
    why = f"held by concurrency key customer:42 (1 running: {first.id})"
    assert ("held", "RUNNING", why) in ledger(orc, second.id)
    assert any(why in w for w in second.warnings)
    assert release(orc) == 0  # the key is busy: nothing released
    drive(orc, pipeline(), run_id=first.id)
    assert orc.run_state(first.id).value == "SUCCEEDED"
    assert release(orc) == 1
    assert run(orc, second.id).held is None
    assert ("released", "RUNNING", "released: concurrency key customer:42 (concurrency hold over)") in ledger(
        orc, second.id
    )
    assert drive(orc, pipeline(), run_id=second.id).run_state() == "SUCCEEDED"


def test_skip_cancels_the_new_submission_with_its_reason(orc: Orchestrator) -> None:
    first = orc.submit(pipeline(), concurrency_key="k", on_busy="skip")
    second = orc.submit(pipeline(), concurrency_key="k", on_busy="skip")
    assert orc.run_state(second.id).value == "CANCELLED"
    assert task_states(orc, second.id) == {"CANCELLED"}
    assert (None, "CANCELLED", f"skipped: concurrency key k busy (1 running: {first.id})") in ledger(orc, second.id)
    assert any(w.startswith("skipped: ") for w in second.warnings)
    assert orc.run_state(first.id).value == "RUNNING" and run(orc, first.id).held is None


def test_cancel_running_cancels_the_admitted_run_and_admits_the_new_one(orc: Orchestrator) -> None:
    first = orc.submit(pipeline(), concurrency_key="k", on_busy="cancel_running")
    second = orc.submit(pipeline(), concurrency_key="k", on_busy="cancel_running")
    assert orc.run_state(first.id).value == "CANCELLED"
    kinds = ledger(orc, first.id)
    assert any(k == "held" and r and f"run {second.id} took concurrency key k" in r for k, _, r in kinds)
    assert any(to == "CANCELLED" for _, to, _ in kinds)
    assert run(orc, second.id).held is None and task_states(orc, second.id) != {"PENDING"}
    assert any(k == "released" for k, _, _ in ledger(orc, second.id))


def test_cancel_running_goes_before_the_runs_the_key_held(orc: Orchestrator) -> None:
    first = orc.submit(pipeline(), concurrency_key="k")
    queued = orc.submit(pipeline(), concurrency_key="k")
    newest = orc.submit(pipeline(), concurrency_key="k", on_busy="cancel_running")
    assert orc.run_state(first.id).value == "CANCELLED" and orc.run_state(queued.id).value == "CANCELLED"
    assert (None, "CANCELLED", f"replaced by run {newest.id} (concurrency key k)") in ledger(orc, queued.id)
    assert run(orc, newest.id).held is None and task_states(orc, newest.id) != {"PENDING"}


def test_replace_queued_keeps_the_latest(orc: Orchestrator) -> None:
    first = orc.submit(pipeline(), concurrency_key="k", on_busy="replace_queued")
    queued = orc.submit(pipeline(), concurrency_key="k", on_busy="replace_queued")
    latest = orc.submit(pipeline(), concurrency_key="k", on_busy="replace_queued")
    assert orc.run_state(queued.id).value == "CANCELLED"
    assert (None, "CANCELLED", f"replaced by run {latest.id} (concurrency key k)") in ledger(orc, queued.id)
    assert run(orc, latest.id).held == "concurrency"
    drive(orc, pipeline(), run_id=first.id)
    assert release(orc) == 1 and run(orc, latest.id).held is None


def test_throttle_holds_beyond_the_rate_until_its_next_slot(orc: Orchestrator) -> None:
    ids = [orc.submit(pipeline(), concurrency_key="api", throttle="2/minute").id for _ in range(3)]
    assert [run(orc, i).held for i in ids] == [None, None, "throttle"]
    first, third = run(orc, ids[0]), run(orc, ids[2])
    assert third.held_until == first.flow_admitted_at + __import__("datetime").timedelta(seconds=60)
    reasons = [r for k, _, r in ledger(orc, ids[2]) if k == "held"]
    assert reasons and reasons[0].startswith("throttled: next slot at ")
    assert release(orc) == 0
    with orc.store.engine.begin() as conn:  # the minute passes (the admissions move back)
        conn.execute(
            sa.text(
                "UPDATE orc_runs SET flow_admitted_at = flow_admitted_at - interval '61 seconds',"
                " held_until = held_until - interval '61 seconds'"
            )
        )
    assert release(orc) == 1 and run(orc, ids[2]).held is None


def test_debounce_merges_a_burst_into_one_run_and_max_wait_bounds_it(orc: Orchestrator) -> None:
    ids = [orc.submit(pipeline(), concurrency_key="idx", debounce=30, max_wait=40).id for _ in range(10)]
    states = [orc.run_state(i).value for i in ids]
    assert states == ["CANCELLED"] * 9 + ["RUNNING"]
    assert (None, "CANCELLED", f"merged into run {ids[1]} (debounce on key idx)") in ledger(orc, ids[0])
    last = run(orc, ids[-1])
    assert last.held == "debounce" and last.flow_first_at == run(orc, ids[0]).flow_first_at
    assert release(orc) == 0  # still quiet for 30 s
    with orc.store.engine.begin() as conn:  # the burst began 35 s ago: max_wait caps the next hold
        conn.execute(sa.text("UPDATE orc_runs SET flow_first_at = flow_first_at - interval '35 seconds'"))
    newest = orc.submit(pipeline(), concurrency_key="idx", debounce=30, max_wait=40)
    row = run(orc, newest.id)
    assert (row.held_until - row.flow_first_at).total_seconds() == pytest.approx(40)
    with orc.store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE orc_runs SET held_until = held_until - interval '1 minute'"))
    assert release(orc) == 1 and run(orc, newest.id).held is None


def test_keys_are_per_tenant(orc: Orchestrator) -> None:
    a = orc.submit(pipeline(tenant="a"), concurrency_key="k")
    b = orc.submit(pipeline(tenant="b"), concurrency_key="k")
    assert run(orc, a.id).held is None and run(orc, b.id).held is None
    assert run(orc, orc.submit(pipeline(tenant="a"), concurrency_key="k").id).held == "concurrency"


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"concurrency_key": "bad key!"}, "concurrency_key"),
        ({"concurrency_key": "k", "max_concurrent": 0}, "max_concurrent"),
        ({"concurrency_key": "k", "on_busy": "drop"}, "on_busy 'drop'"),
        ({"concurrency_key": "k", "throttle": "10/fortnight"}, "throttle"),
        ({"concurrency_key": "k", "debounce": "soon"}, "debounce"),
        ({"concurrency_key": "k", "debounce": 10, "max_wait": 5}, "max_wait"),
        ({"max_concurrent": 2}, "needs a concurrency_key"),
    ],
)
def test_bad_options_are_refused_before_anything_is_written(
    orc: Orchestrator, options: dict[str, Any], words: str
) -> None:
    with orc.store.engine.connect() as conn:
        before = conn.execute(sa.select(sa.func.count()).select_from(s.runs)).scalar_one()
    with pytest.raises(FlowControlError, match=words):
        orc.submit(pipeline(), **options)
    with orc.store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(s.runs)).scalar_one() == before


def test_explain_and_the_runs_list_say_why_a_run_is_held(orc: Orchestrator) -> None:
    first = orc.submit(pipeline(), concurrency_key="customer:42")
    second = orc.submit(pipeline(), concurrency_key="customer:42")
    found = orc.explain(second.id)
    assert {e.reasons[0].detail for e in found} == {f"held by concurrency key customer:42 (1 running: {first.id})"}
    assert all(e.reasons[0].kind == "held" for e in found)
    assert all(e.reasons[0].kind != "held" for e in orc.explain(first.id) if e.reasons)
    view = orc.visible(second.id)
    assert (view.flow_key, view.held) == ("customer:42", "concurrency")
    assert view.to_json()["concurrency_key"] == "customer:42" and view.to_json()["held"] == "concurrency"
    throttled = [orc.submit(pipeline(), concurrency_key="api", throttle="1/hour") for _ in range(2)][1]
    assert orc.explain(throttled.id)[0].reasons[0].detail.startswith("throttled: next slot at ")
    debounced = orc.submit(pipeline(), concurrency_key="idx", debounce="30s")
    assert orc.explain(debounced.id)[0].reasons[0].detail.startswith("debounced until ")


def test_the_command_line_submits_with_a_key_and_lists_the_held_state(
    orc: Orchestrator, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(cli_base, "_ready_store", lambda: orc)
    spec = tmp_path / "sync.yaml"
    spec.write_text("name: sync\nnodes:\n  - {key: extract, task: t}\n")
    runner = CliRunner()
    first = runner.invoke(cli.main, ["submit", str(spec), "--concurrency-key", "customer:7"])
    assert first.exit_code == 0, first.output
    second = runner.invoke(cli.main, ["submit", str(spec), "--concurrency-key", "customer:7", "--on-busy", "queue"])
    assert second.exit_code == 0, second.output
    held_id = second.stdout.split()[0]
    assert run(orc, held_id).held == "concurrency"
    assert "warning: held by concurrency key customer:7" in second.output
    listed = runner.invoke(cli.main, ["runs"])
    line = next(x for x in listed.output.splitlines() if x.startswith(held_id))
    assert line.endswith("key=customer:7 (held: concurrency)")
    bad = runner.invoke(cli.main, ["submit", str(spec), "--concurrency-key", "k", "--throttle", "lots"])
    assert bad.exit_code != 0 and "throttle 'lots'" in bad.output


def test_a_held_run_is_not_flagged_idle_by_the_watchdog(orc: Orchestrator) -> None:
    """A run keyed flow control holds waits by design (explain says why): the watchdog's idle
    check leaves it alone, and still flags an admitted run with no transition for that long."""
    first = orc.submit(pipeline(), concurrency_key="slow", throttle="1/hour")
    second = orc.submit(pipeline(), concurrency_key="slow", throttle="1/hour")
    assert run(orc, second.id).held == "throttle"
    with orc.store.engine.begin() as conn:  # two hours pass with no transition
        conn.execute(sa.text("UPDATE orc_runs SET created_at = created_at - interval '2 hours'"))
        conn.execute(sa.text("UPDATE orc_task_events SET at = at - interval '2 hours'"))
    flagged = {s.run_id for s in orc.store.recovery.watch(3600, scan_ready=False)}
    assert second.id not in flagged and run(orc, second.id).stuck is None
    assert first.id in flagged


def test_cancels_meet_the_key_a_held_run_cancelled_stays_cancelled_and_the_next_one_goes(orc: Orchestrator) -> None:
    # the key's running run and two held behind it; the operator cancels the first held one (by a
    # bulk cancel of its tag) and then the running one
    first = orc.submit(pipeline(), concurrency_key="k")
    second = orc.submit(pipeline(), concurrency_key="k", tags={"batch": "old"})
    third = orc.submit(pipeline(), concurrency_key="k")
    assert (run(orc, second.id).held, run(orc, third.id).held) == ("concurrency", "concurrency")
    report = orc.bulk.cancel(tags={"batch": "old"})
    assert [(i.run_id, i.outcome) for i in report.items] == [(second.id, "done")], report
    assert orc.run_state(second.id).value == "CANCELLED"
    assert release(orc) == 0  # the key is still busy with the first
    orc.cancel(first.id)
    orc.reconcile()  # closes the cancelled run: the key frees
    assert orc.run_state(first.id).value == "CANCELLED"
    # then the cancelled held run is never released (the release is fenced on RUNNING): the third goes
    assert run(orc, second.id).state == "CANCELLED"
    assert run(orc, third.id).held is None
    assert not [r for r in ledger(orc, second.id) if r[0] == "released"]
    assert drive(orc, pipeline(), run_id=third.id).run_state() == "SUCCEEDED"
