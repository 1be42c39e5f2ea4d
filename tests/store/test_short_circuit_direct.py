"""A short circuit with ``ignore_downstream_trigger_rules=False`` (migration 0025): its falsy
result skips only its direct children; the tasks below follow their own rules, also after a
clear (a direct child cleared is skipped again; one further below is decided by its rule)."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator import DAG, Orchestrator, Settings
from orchestrator.core.errors import ValidationError
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from orchestrator.core.routing import default_queues


@pytest.fixture
def orc(pg_clean: str) -> Orchestrator:
    orc = Orchestrator(Settings(database_url=pg_clean), publisher=RecordingPublisher(), registry=StaticRegistry(["t"]))
    orc.register_worker("w", default_queues(), 10)
    return orc


def finish(orc: Orchestrator, results: dict[str, Any]) -> None:
    """Run every dispatched task: each returns ``results.get(key, "ok")``."""
    while batch := orc.publisher.take():  # type: ignore[attr-defined]
        for d in batch:
            assert orc.claim(d.token, "w:1", d.task_name) is not None
            orc.complete(d.token, results.get(d.key, "ok"))


def circuit(direct: bool) -> DAG:
    dag = DAG("direct" if direct else "everything")
    dag.task("gate", "t", short_circuit=True, ignore_downstream_trigger_rules=not direct)
    dag.task("child", "t", upstream=["gate"])
    dag.task("grandchild", "t", upstream=["child"])
    dag.task("after", "t", upstream=["grandchild"], trigger_rule="all_done")
    return dag


def states(orc: Orchestrator, run_id: str) -> dict[str, str]:
    return {t.key: t.state.value for t in orc.tasks(run_id)}


def test_only_the_direct_children_are_skipped_and_the_rest_follow_their_rules(orc: Orchestrator) -> None:
    run = orc.submit(circuit(direct=True))
    finish(orc, {"gate": 0})
    assert states(orc, run.id) == {
        "gate": "SUCCEEDED", "child": "SKIPPED", "grandchild": "SKIPPED", "after": "SUCCEEDED",
    }  # fmt: skip
    # the default skips everything below, whatever the rules (all_done included)
    run2 = orc.submit(circuit(direct=False))
    finish(orc, {"gate": 0})
    assert states(orc, run2.id)["after"] == "SKIPPED"
    # a clear keeps the short circuit's choice: its direct child is skipped again, the task
    # below decided by its rule (all_done: runs)
    orc.clear(run.id, "child", "after", setup=False)
    finish(orc, {})
    got = states(orc, run.id)
    assert got["child"] == "SKIPPED" and got["after"] == "SUCCEEDED", got


def test_the_option_belongs_to_a_short_circuit() -> None:
    dag = DAG("bad")
    dag.task("x", "t", ignore_downstream_trigger_rules=False)
    with pytest.raises(ValidationError, match="short circuit's option"):
        dag.validate()
    spec = circuit(direct=True).to_spec()
    assert spec["nodes"][0]["ignore_downstream_trigger_rules"] is False
