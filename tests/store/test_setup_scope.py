"""Clearing a task clears the setups it works under and their teardowns, as Airflow's clear does
(``BaseOperator.get_upstreams_only_setups_and_teardowns``: a setup upstream of the task that has a
teardown downstream of it, or has no teardown, and that setup's teardowns), unless ``setup=False``
(the CLI's ``--no-setup``). The DAG is Airflow's ``example_setup_teardown_taskflow``
(airflow/example_dags/), its task group's keys prefixed by hand; the expected sets are derived
from that method, the reason beside each."""

from __future__ import annotations

import pytest

from orchestrator import DAG, Orchestrator, Settings
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from orchestrator.core.routing import default_queues
from orchestrator.store.operator import setup_scope


@pytest.fixture
def orc(pg_clean: str) -> Orchestrator:
    orc = Orchestrator(Settings(database_url=pg_clean), publisher=RecordingPublisher(), registry=StaticRegistry(["t"]))
    orc.register_worker("w", default_queues(), 10)
    return orc


def example_setup_teardown_taskflow() -> DAG:
    dag = DAG("example_setup_teardown_taskflow")
    # task_1 >> task_2 >> task_3.as_teardown(setups=task_1): task_1 becomes a setup, task_1 >> task_3
    dag.task("my_first_task", "t", setup=True)
    dag.task("my_second_task", "t", upstream=["my_first_task"])
    dag.task("my_third_task", "t", upstream=["my_second_task", "my_first_task"], teardown=True)
    # with s >> t: outer_normal_task()
    dag.task("outer_setup", "t", setup=True)
    dag.task("outer_normal_task", "t", upstream=["outer_setup"])
    # section_1: inner_setup is a plain task; inner_normal_task(s) >> inner_teardown(s).as_teardown();
    # s >> section_1() >> t (the group's leaves leave out its teardown: inner_normal_task >> t)
    dag.task("section_1__inner_setup", "t", upstream=["outer_setup"])
    dag.task("section_1__inner_normal_task", "t", upstream=["section_1__inner_setup"])
    dag.task(
        "section_1__inner_teardown", "t", upstream=["section_1__inner_normal_task", "section_1__inner_setup"],
        teardown=True,
    )  # fmt: skip
    dag.task("outer_teardown", "t", upstream=["outer_setup", "outer_normal_task", "section_1__inner_normal_task"],
             teardown=True)  # fmt: skip
    return dag


def test_clearing_a_task_takes_its_setups_and_their_teardowns_as_airflow_does(orc: Orchestrator) -> None:
    run = orc.submit(example_setup_teardown_taskflow())

    def cleared(key: str, **kw: bool) -> set[str]:
        return set(orc.clear(run.id, key, dry_run=True, **kw))

    # the example's own comment: "if you clear task_2, then its setup task, task_1, will be cleared
    # in addition to its teardown task, task_3"
    assert cleared("my_second_task") == {"my_first_task", "my_second_task", "my_third_task"}
    # outer_setup is upstream and its teardown outer_teardown is downstream: both come along
    assert cleared("outer_normal_task") == {"outer_setup", "outer_normal_task", "outer_teardown"}
    # inner_setup is a plain task (not a setup): not taken; outer_setup is, with outer_teardown below
    # the task; inner_teardown is no teardown of a setup taken, so it stays
    assert cleared("section_1__inner_normal_task") == {"outer_setup", "section_1__inner_normal_task", "outer_teardown"}
    # partial_subset: a setup cleared takes its teardowns ("if t.is_setup and not include_downstream")
    assert cleared("my_first_task") == {"my_first_task", "my_third_task"}
    # and a teardown takes no setups above it ("if not t.is_setup and not t.is_teardown")
    assert cleared("my_third_task") == {"my_third_task"}
    # opting out, as Airflow's UI allows
    assert cleared("my_second_task", setup=False) == {"my_second_task"}


def test_a_setup_without_teardown_is_taken_and_one_whose_teardown_is_above_is_not() -> None:
    children = {"s1": ["w"], "s2": ["td2", "w"], "td2": [], "w": ["after"], "after": []}
    roles = {"s1": "setup", "s2": "setup", "td2": "teardown"}
    # s1 has no teardown: taken; s2's teardown td2 is not below w: not taken
    assert setup_scope({"w"}, children, roles) == {"s1"}
