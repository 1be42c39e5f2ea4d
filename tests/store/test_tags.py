"""Tags on runs and bulk actions on one database (issue 34): ``submit(..., tags=)`` checked before
anything is written, stored on ``orc_runs.tags`` and shown in the run's view; ``runs(tags=)``
filtering by containment together with the state and the DAG; a tenant-bound orchestrator that
sees and acts on its tenant's runs only; ``orc.bulk`` cancel / retry / rerun, its dry run (nothing
written) and its refusals (no filter, too many runs)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, Orchestrator, RunState, ValidationError
from orchestrator.core.errors import BulkFilterError, TagError
from orchestrator.engine import bulk as bulk_module
from orchestrator.store import schema as s
from tests.store.dynamic import Fail, drive, orchestrator

pytestmark = pytest.mark.postgres


@pytest.fixture
def orc(pg_clean: str) -> Iterator[Orchestrator]:
    o = orchestrator(pg_clean)
    yield o
    o.store.attempts.hot.close()
    o.store.dispose()


def pipeline(name: str = "etl") -> DAG:
    dag = DAG(name)
    dag.task("extract", "t")
    dag.task("load", "t", upstream=["extract"])
    return dag


def failing(*keys: str) -> Any:
    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        if key in keys:
            raise Fail(f"{key} broke")
        return key

    return body


def written(orc: Orchestrator) -> tuple[int, int, int]:
    """Rows of runs, tasks and ledger events: what a refused call must not change."""
    with orc.store.engine.connect() as conn:
        return tuple(  # type: ignore[return-value]
            int(conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one())
            for t in (s.runs, s.tasks, s.events)
        )


def tagged_runs(orc: Orchestrator) -> dict[str, str]:
    """Six finished runs of two DAGs, two customers and two outcomes: their ids by a name."""
    ids = {}
    for name, dag, customer, fail in (
        ("ok42", "etl", "42", ()),
        ("bad42", "etl", "42", ("extract",)),
        ("bad42b", "etl", "42", ("load",)),
        ("bad7", "etl", "7", ("extract",)),
        ("other42", "report", "42", ("extract",)),
        ("untagged", "etl", None, ("extract",)),
    ):
        tags = {"customer": customer, "region": "eu"} if customer else None
        run_id = orc.submit(pipeline(dag), tags=tags).id
        drive(orc, pipeline(dag), failing(*fail), run_id=run_id)
        ids[name] = run_id
    return ids


# ------------------------------------------------------------------ submit and the run's view


def test_tags_are_stored_and_shown_in_the_runs_view_and_json(orc: Orchestrator) -> None:
    run = orc.submit(pipeline(), tags={"customer": "42", "region": "eu"})
    view = run.status()
    assert view.tags == {"customer": "42", "region": "eu"}
    assert view.to_json()["tags"] == {"customer": "42", "region": "eu"}
    assert orc.submit(pipeline()).status().tags == {}
    with orc.store.engine.connect() as conn:
        stored = conn.execute(sa.select(s.runs.c.tags).where(s.runs.c.id == run.id)).scalar_one()
    assert stored == {"customer": "42", "region": "eu"}


@pytest.mark.parametrize(
    ("tags", "named"),
    [
        (["customer"], "must be a mapping"),
        ({"customer": 42}, "tag 'customer': the value must be a string, not int"),
        ({42: "x"}, "a tag's key must be a string, not int"),
        ({"bad key": "x"}, "tag key 'bad key' must be 1-64"),
        ({"a=b": "x"}, "tag key 'a=b'"),
        ({"k" * 65: "x"}, "must be 1-64"),
        ({"customer": ""}, "tag 'customer': the value must not be empty"),
        ({"customer": "x" * 201}, "tag 'customer': the value is 201 characters, over 200"),
        ({"customer": "a\nb"}, "tag 'customer': the value holds the control character"),
        ({f"k{i}": "v" for i in range(17)}, "17 tags, over the 16"),
    ],
)
def test_bad_tags_are_refused_naming_the_problem_and_nothing_is_written(
    orc: Orchestrator, tags: Any, named: str
) -> None:
    before = written(orc)
    with pytest.raises(TagError, match=None) as refused:
        orc.submit(pipeline(), tags=tags)
    assert isinstance(refused.value, ValidationError)
    assert named in str(refused.value), str(refused.value)
    assert written(orc) == before == (0, 0, 0)
    assert orc.publisher.take() == []  # type: ignore[attr-defined]


def test_a_repeated_idempotent_submit_returns_the_first_run_with_its_tags(orc: Orchestrator) -> None:
    first = orc.submit(pipeline(), idempotency_key="k1", tags={"customer": "42"})
    again = orc.submit(pipeline(), idempotency_key="k1", tags={"customer": "7"})
    assert again.id == first.id and again.status().tags == {"customer": "42"}


def test_a_rerun_keeps_the_runs_tags(orc: Orchestrator) -> None:
    run_id = orc.submit(pipeline(), tags={"customer": "42"}).id
    drive(orc, pipeline(), failing("extract"), run_id=run_id)
    again = orc.rerun(run_id)
    assert again.status().tags == {"customer": "42"} and again.status().rerun_of == run_id


# ------------------------------------------------------------------ the filter


def test_runs_filter_by_tags_and_state_and_dag(orc: Orchestrator) -> None:
    ids = tagged_runs(orc)

    def found(**filters: Any) -> set[str]:
        return {v.id for v in orc.runs(100, **filters)}

    assert found(tags={"customer": "42"}) == {ids["ok42"], ids["bad42"], ids["bad42b"], ids["other42"]}
    assert found(tags={"customer": "42", "region": "eu"}) == found(tags={"customer": "42"})
    assert found(tags={"customer": "42", "region": "us"}) == set()
    assert found(tags={"customer": "4"}) == set()  # a value matches whole, never a prefix
    assert found(tags={"customer": "42"}, state="FAILED") == {ids["bad42"], ids["bad42b"], ids["other42"]}
    assert found(tags={"customer": "42"}, state=RunState.FAILED, dag="etl") == {ids["bad42"], ids["bad42b"]}
    assert found(tags={"region": "eu"}, dag="etl", state="SUCCEEDED") == {ids["ok42"]}
    assert found(tags={}) == set(ids.values())  # an empty filter filters nothing
    with pytest.raises(TagError, match="the tag filter: tag key 'bad key'"):
        orc.runs(10, tags={"bad key": "x"})


def test_a_tenant_bound_orchestrator_sees_and_acts_on_its_tenants_runs_only(orc: Orchestrator) -> None:
    mine = orc.submit(pipeline(), tenant="acme", tags={"customer": "42"}).id
    theirs = orc.submit(pipeline(), tenant="bravo", tags={"customer": "42"}).id
    for run_id in (mine, theirs):
        drive(orc, pipeline(), failing("extract"), run_id=run_id)
    acme = Orchestrator(orc.settings, store=orc.store, publisher=orc.publisher, registry=orc.registry, tenant="acme")
    assert [v.id for v in acme.runs(10, tags={"customer": "42"})] == [mine]
    assert acme.runs(10, tenant="bravo", tags={"customer": "42"}) == []
    assert [v.id for v in acme.bulk.select(tags={"customer": "42"})] == [mine]
    report = acme.bulk.retry(tags={"customer": "42"}, state="FAILED", by="alice")
    assert [(i.run_id, i.outcome) for i in report.items] == [(mine, "done")]
    assert orc.run_state(mine) is RunState.RUNNING and orc.run_state(theirs) is RunState.FAILED
    assert {t.attempt for t in orc.tasks(theirs)} == {1}
    # and a submit of the bound orchestrator is its tenant's, with its tags
    assert acme.submit(pipeline(), tags={"customer": "9"}).status().tenant == "acme"


# ------------------------------------------------------------------ bulk actions


def test_a_bulk_action_without_a_filter_is_refused_and_touches_nothing(orc: Orchestrator) -> None:
    ids = tagged_runs(orc)
    before = written(orc)
    for action in ("cancel", "retry", "rerun"):
        with pytest.raises(BulkFilterError, match="a bulk action needs a filter"):
            orc.bulk.apply(action)
        with pytest.raises(BulkFilterError, match="needs a filter"):
            orc.bulk.apply(action, tags={}, state="", dag="", tenant="default")
    with pytest.raises(ValidationError, match="unknown bulk action 'purge'"):
        orc.bulk.apply("purge", tags={"customer": "42"})
    with pytest.raises(ValidationError, match="unknown run state 'broken'"):
        orc.bulk.retry(state="broken")
    with pytest.raises(TagError):
        orc.bulk.retry(tags={"customer": 42})
    assert written(orc) == before
    assert orc.run_state(ids["bad42"]) is RunState.FAILED


def test_too_many_matching_runs_are_refused(orc: Orchestrator, monkeypatch: pytest.MonkeyPatch) -> None:
    tagged_runs(orc)
    monkeypatch.setattr(bulk_module, "MAX_BULK_RUNS", 3)
    before = written(orc)
    with pytest.raises(BulkFilterError, match="more than 3 runs match"):
        orc.bulk.retry(tags={"customer": "42"}, dry_run=True)
    assert len(orc.bulk.select(tags={"customer": "42"}, state="FAILED")) == 3
    assert written(orc) == before


def test_bulk_retry_dry_run_writes_nothing_then_retries_exactly_the_failed_matching_runs(orc: Orchestrator) -> None:
    ids = tagged_runs(orc)
    before = written(orc)
    plan = orc.bulk.retry(tags={"customer": "42"}, dag="etl", dry_run=True)
    assert written(orc) == before
    outcomes = {i.run_id: (i.outcome, i.detail) for i in plan.items}
    assert set(outcomes) == {ids["ok42"], ids["bad42"], ids["bad42b"]}
    assert outcomes[ids["ok42"]] == ("skipped", "run SUCCEEDED: nothing to retry")
    assert outcomes[ids["bad42"]][0] == "planned"
    assert (
        "clear 1 FAILED task(s) with their failed downstream, 2 task(s) to run again: extract, load"
        in (outcomes[ids["bad42"]][1])
    )
    assert outcomes[ids["bad42b"]] == (
        "planned",
        "clear 1 FAILED task(s) with their failed downstream, 1 task(s) to run again: load",
    )
    assert (plan.changed, plan.count("skipped"), plan.count("failed")) == (2, 1, 0)
    assert plan.summary().startswith("bulk retry (dry run: nothing written): 2 run(s) would retry, 1 skipped")
    assert plan.to_json()["filter"] == {"tags": {"customer": "42"}, "state": None, "dag": "etl", "tenant": None}

    done = orc.bulk.retry(tags={"customer": "42"}, dag="etl", state="FAILED", by="ops")
    assert {i.run_id: i.outcome for i in done.items} == {ids["bad42"]: "done", ids["bad42b"]: "done"}
    for run_id in (ids["bad42"], ids["bad42b"]):
        assert orc.run_state(run_id) is RunState.RUNNING
        assert {e.by for e in orc.ledger(run_id) if e.actor == "operator"} == {"ops"}
        drive(orc, pipeline(), run_id=run_id)  # the fixed bodies now succeed
        assert orc.run_state(run_id) is RunState.SUCCEEDED
    # the runs it did not match are as they were
    for name in ("bad7", "other42", "untagged"):
        assert orc.run_state(ids[name]) is RunState.FAILED
        assert {t.attempt for t in orc.tasks(ids[name])} == {1}


def test_bulk_cancel_and_rerun_skip_the_runs_they_do_not_apply_to(orc: Orchestrator) -> None:
    running = orc.submit(pipeline(), tags={"batch": "b1"}).id
    finished = orc.submit(pipeline(), tags={"batch": "b1"}).id
    drive(orc, pipeline(), run_id=finished)
    cancel = orc.bulk.cancel(tags={"batch": "b1"}, by="ops")
    items = {i.run_id: i for i in cancel.items}
    assert items[running].outcome == "done" and items[running].detail.startswith("cancelled;")
    assert (items[finished].outcome, items[finished].detail) == (
        "skipped",
        "run is SUCCEEDED: only a RUNNING run can be cancelled",
    )
    assert orc.run_state(running) is RunState.CANCELLED
    again = orc.bulk.cancel(tags={"batch": "b1"})
    assert {i.detail for i in again.items} >= {"already CANCELLED: only a RUNNING run can be cancelled"}
    assert again.changed == 0

    retry = orc.bulk.retry(tags={"batch": "b1"})
    assert {i.run_id: i.detail for i in retry.items} == {
        running: "run is CANCELLED: its tasks cannot be retried (rerun it instead)",
        finished: "run SUCCEEDED: nothing to retry",
    }
    still = orc.submit(pipeline(), tags={"batch": "b1"}).id
    rerun = orc.bulk.rerun(tags={"batch": "b1"})
    by_run = {i.run_id: i for i in rerun.items}
    assert by_run[still].outcome == "skipped" and by_run[still].detail.startswith("run is RUNNING")
    new_runs = {i.new_run for i in rerun.items if i.outcome == "done"}
    assert len(new_runs) == 2 and None not in new_runs
    for new in new_runs:
        view = orc.visible(str(new))
        assert view.tags == {"batch": "b1"} and view.rerun_of in (running, finished)
