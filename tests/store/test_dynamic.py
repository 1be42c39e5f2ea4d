"""Dynamic DAGs in the store: maps, branches, short circuits, skips, setup and teardown, and the
operator's retry of a map's child. The workers' part is played by ``dynamic.drive``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator import DAG, Orchestrator, Skip, ValidationError
from orchestrator.services.invariants import check_runs
from tests.store.dynamic import Fail, drive, orchestrator

pytestmark = pytest.mark.postgres


@pytest.fixture
def orc(pg_clean: str) -> Iterator[Orchestrator]:
    o = orchestrator(pg_clean)
    yield o
    o.store.attempts.hot.close()
    o.store.dispose()


def listing(items: Any) -> Any:
    """A body: ``ls`` returns ``items``, a mapped child returns its item doubled, others their upstream."""

    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        if key == "ls":
            return items
        if "[" in key:
            return kw["x"] * 2
        return up

    return body


def mapped(n_items: Any = None, **map_options: Any) -> DAG:
    dag = DAG("mapped")
    dag.task("ls", "t")
    dag.map("m", "t", over="ls", kwarg="x", **map_options)
    dag.task("join", "up", upstream=["m"])
    return dag


def test_a_map_over_a_list_runs_one_child_per_item_and_the_join_gets_the_results_in_order(orc: Orchestrator) -> None:
    d = drive(orc, mapped(), listing([3, 1, 2]))
    states = d.states()
    assert d.run_state() == "SUCCEEDED"
    assert {k: v for k, v in states.items() if k.startswith("m[")} == {f"m[{i}]": "SUCCEEDED" for i in range(3)}
    assert states["m"] == "SUCCEEDED"
    assert d.ran[-1] == ("join", {}, {"m": [6, 2, 4]})
    child = orc.task(d.run_id, "m[1]")
    assert (child.map_parent, child.map_index, child.map_key, child.kwargs) == ("m", 1, "1", {"x": 1})
    assert orc.task(d.run_id, "m").map_counts == {"total": 3, "done": 3, "succeeded": 3, "failed": 0, "skipped": 0}
    assert check_runs(orc.store, [d.run_id]) == []


def test_a_map_over_a_dict_keys_its_children_by_the_dicts_keys(orc: Orchestrator) -> None:
    d = drive(orc, mapped(), listing({"eu": 1, "us": 2}))
    assert d.ran[-1] == ("join", {}, {"m": [2, 4]})
    assert {k for k in d.states() if k.startswith("m[")} == {"m[eu]", "m[us]"}


def test_map_key_names_each_child_by_an_item_field(orc: Orchestrator) -> None:
    dag = DAG("keyed")
    dag.task("ls", "t")
    dag.map("m", "t", over="ls", kwarg="row", map_key="id")
    d = drive(orc, dag, lambda k, kw, up: [{"id": "a-1"}, {"id": "b.2"}] if k == "ls" else kw["row"]["id"])
    assert sorted(k for k in d.states() if "[" in k) == ["m[a-1]", "m[b.2]"]
    assert d.run_state() == "SUCCEEDED"


@pytest.mark.parametrize(
    ("on_empty", "header", "join"), [("skip", "SKIPPED", "SKIPPED"), ("success", "SUCCEEDED", "SUCCEEDED")]
)
def test_an_empty_map_follows_on_empty(orc: Orchestrator, on_empty: str, header: str, join: str) -> None:
    d = drive(orc, mapped(on_empty=on_empty), listing([]))
    assert d.states() == {"ls": "SUCCEEDED", "m": header, "join": join}
    task = orc.task(d.run_id, "m")
    if on_empty == "skip":
        assert task.skip_reason == "empty_map" and orc.task(d.run_id, "join").skip_reason == "upstream_skipped"
    else:
        assert d.ran[-1] == ("join", {}, {"m": []})
    assert d.run_state() == "SUCCEEDED"


def test_a_map_of_one_item(orc: Orchestrator) -> None:
    d = drive(orc, mapped(), listing([5]))
    assert d.ran[-1] == ("join", {}, {"m": [10]})


def test_a_wide_map_expands_in_one_transaction_and_joins_once(orc: Orchestrator) -> None:
    d = drive(orc, mapped(), listing(list(range(500))))
    assert d.run_state() == "SUCCEEDED"
    assert [k for k, _, _ in d.ran].count("join") == 1
    assert d.ran[-1][2]["m"] == [2 * i for i in range(500)]
    run = orc.run(d.run_id).status()
    assert run.task_count == 3 + 500
    assert check_runs(orc.store, [d.run_id]) == []


def test_zipped_and_crossed_arguments(orc: Orchestrator) -> None:
    dag = DAG("zip")
    dag.task("ls", "t")
    dag.map("z", "t", over={"a": "ls", "b": [10, 20]}, combine="zip")
    dag.map("p", "t", over={"a": [1, 2], "b": ["x", "y", "z"]}, combine="product")
    d = drive(orc, dag, lambda k, kw, up: [1, 2] if k == "ls" else kw)
    by_key = {k: kw for k, kw, _ in d.ran}
    assert by_key["z[0]"] == {"a": 1, "b": 10} and by_key["z[1]"] == {"a": 2, "b": 20}
    assert len([k for k in by_key if k.startswith("p[")]) == 6
    assert by_key["p[1,2]"] == {"a": 2, "b": "z"}
    assert d.run_state() == "SUCCEEDED"


def test_a_strict_zip_of_unequal_lengths_fails_the_map_with_a_map_error(orc: Orchestrator) -> None:
    dag = DAG("zip-bad")
    dag.task("ls", "t")
    dag.map("z", "t", over={"a": "ls", "b": [10, 20]}, combine="zip_strict")
    d = drive(orc, dag, lambda k, kw, up: [1, 2, 3])
    z = orc.task(d.run_id, "z")
    assert z.state.value == "FAILED" and z.error is not None and z.error.startswith("MapError: zip of 3 and 2")
    assert "zip_strict" in z.error
    assert d.run_state() == "FAILED"


@pytest.mark.parametrize("result", ["a string", 42, None])
def test_a_source_result_that_is_not_a_list_fails_the_source_with_a_named_error(orc: Orchestrator, result: Any) -> None:
    d = drive(orc, mapped(), listing(result))
    ls = orc.task(d.run_id, "ls")
    assert ls.state.value == "FAILED" and ls.error is not None and ls.error.startswith("MapError: m maps over")
    assert d.states()["m"] == "UPSTREAM_FAILED" and d.run_state() == "FAILED"
    assert [k for k, _, _ in d.ran] == ["ls"]  # no retry: the result would be the same


def test_a_source_result_longer_than_max_map_length_fails_the_source(orc: Orchestrator) -> None:
    d = drive(orc, mapped(max_map_length=3), listing([1, 2, 3, 4]))
    ls = orc.task(d.run_id, "ls")
    assert ls.state.value == "FAILED" and "over its max_map_length 3" in (ls.error or "")


def test_repeated_or_invalid_map_keys_fail_the_map(orc: Orchestrator) -> None:
    dag = DAG("keys")
    dag.task("ls", "t")
    dag.map("m", "t", over="ls", kwarg="row", map_key="id")
    d = drive(orc, dag, lambda k, kw, up: [{"id": "a"}, {"id": "a"}])
    assert "repeat a map key" in (orc.task(d.run_id, "m").error or "")
    d = drive(orc, dag, lambda k, kw, up: [{"id": "no spaces"}])
    assert "is not 1-100 letters" in (orc.task(d.run_id, "m").error or "")


def test_a_chained_map_runs_item_by_item_depth_first(orc: Orchestrator) -> None:
    dag = DAG("chain")
    dag.task("ls", "t")
    dag.map("s1", "t", over="ls", kwarg="x")
    dag.map("s2", "t", over="s1", kwarg="y")
    dag.map("s3", "t", over="s2", kwarg="z")
    dag.task("end", "up", upstream=["s3"])

    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        if key == "ls":
            return [1, 2, 3, 4]
        if key.startswith("s1["):
            return kw["x"] * 10
        if key.startswith("s2["):
            return kw["y"] + 1
        if key.startswith("s3["):
            return kw["z"] * 2
        return up

    d = drive(orc, dag, body)
    order = [k for k, _, _ in d.ran]
    assert order.index("s3[0]") < order.index("s1[3]")  # item 0 finished all stages before the last item started
    assert d.ran[-1] == ("end", {}, {"s3": [22, 42, 62, 82]})
    assert d.run_state() == "SUCCEEDED"
    assert check_runs(orc.store, [d.run_id]) == []


def test_a_failed_item_of_a_chained_map_fails_only_its_own_later_stages(orc: Orchestrator) -> None:
    dag = DAG("chain-fail")
    dag.task("ls", "t")
    dag.map("s1", "t", over="ls", kwarg="x")
    dag.map("s2", "t", over="s1", kwarg="y")

    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        if key == "ls":
            return [1, 2, 3]
        if key == "s1[1]":
            raise Fail("bad item")
        return 0

    d = drive(orc, dag, body)
    states = d.states()
    assert states["s2[1]"] == "UPSTREAM_FAILED" and states["s2[0]"] == states["s2[2]"] == "SUCCEEDED"
    assert states["s1"] == states["s2"] == "FAILED" and d.run_state() == "FAILED"


def test_a_map_over_literal_items_expands_at_submit(orc: Orchestrator) -> None:
    dag = DAG("literal")
    dag.map("m", "t", over=["a", "b"], kwarg="x")
    dag.task("after", "up", upstream=["m"])
    d = drive(orc, dag, lambda k, kw, up: kw.get("x", up))
    assert d.ran[-1] == ("after", {}, {"m": ["a", "b"]})
    empty = DAG("literal-empty")
    empty.map("m", "t", over=[], kwarg="x")
    handle = orc.submit(empty)
    assert orc.run_state(handle.id).value == "SUCCEEDED"  # nothing to run: closed at submit
    assert orc.task(handle.id, "m").skip_reason == "empty_map"


def test_max_active_bounds_a_maps_children_in_flight(orc: Orchestrator) -> None:
    dag = mapped(max_active=2)
    seen: list[int] = []

    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        if key == "ls":
            return list(range(6))
        if "[" in key:
            live = [
                t
                for t in orc.tasks(d_run[0])
                if t.map_parent == "m" and t.state.value in ("READY", "QUEUED", "RUNNING")
            ]
            seen.append(len(live))
        return 1

    d_run: list[str] = []
    handle = orc.submit(dag)
    d_run.append(handle.id)
    d = drive(orc, dag, body, run_id=handle.id)
    assert d.run_state() == "SUCCEEDED" and max(seen) <= 2 and len(seen) == 6


def test_join_with_min_success_ratio_runs_when_enough_children_succeeded(orc: Orchestrator) -> None:
    dag = DAG("ratio")
    dag.task("ls", "t")
    dag.map("m", "t", over="ls", kwarg="x")
    dag.task("join", "up", upstream=["m"], min_success_ratio=0.75)

    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        if key == "ls":
            return [0, 1, 2, 3]
        if key == "m[2]":
            raise Fail("one bad item")
        return up if key == "join" else kw["x"]

    d = drive(orc, dag, body)
    assert d.states()["join"] == "SUCCEEDED"
    assert d.ran[-1] == ("join", {}, {"m": [0, 1, 3]})
    # two failures of four: below 0.75, the join is decided early
    d = drive(orc, dag, lambda k, kw, up: [0, 1, 2, 3] if k == "ls" else (_ for _ in ()).throw(Fail("x")))
    assert d.states()["join"] == "UPSTREAM_FAILED"


def test_one_success_over_a_map_runs_after_the_first_child(orc: Orchestrator) -> None:
    dag = DAG("first")
    dag.task("ls", "t")
    dag.map("m", "t", over="ls", kwarg="x")
    dag.task("early", "t", upstream=["m"], trigger_rule="one_success")
    order: list[str] = []

    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        order.append(key)
        return [1, 2, 3] if key == "ls" else 1

    d = drive(orc, dag, body, until=lambda dr: "early" in order)
    events = [e for e in orc.ledger(d.run_id) if e.key == "early" and e.to_state == "READY"]
    assert events and "early verdict (1 of 3 upstream done)" in (events[0].reason or "")


def test_operator_retries_a_map_child_and_the_map_reopens(orc: Orchestrator) -> None:
    dag = DAG("retry-child")
    dag.task("ls", "t")
    dag.map("m", "t", over="ls", kwarg="x")
    failing = {"m[1]", "m[2]"}

    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        if key == "ls":
            return [0, 1, 2]
        if key in failing:
            raise Fail("flaky")
        return 1

    d = drive(orc, dag, body)
    assert d.states()["m"] == "FAILED" and d.run_state() == "FAILED"
    failing.clear()
    orc.retry_task(d.run_id, "m[1]", by="tester")
    assert orc.task(d.run_id, "m").state.value == "MAPPED" and d.run_state() == "RUNNING"
    orc.retry_task(d.run_id, "m", by="tester")  # the whole map: the other failed child
    d = drive(orc, dag, body, run_id=d.run_id)
    assert d.states()["m"] == "SUCCEEDED" and d.run_state() == "SUCCEEDED"
    with pytest.raises(Exception, match="no FAILED or DEAD_LETTER child"):
        orc.retry_task(d.run_id, "m", by="tester")
    assert check_runs(orc.store, [d.run_id]) == []


def test_a_branch_follows_the_chosen_children_and_skips_the_others(orc: Orchestrator) -> None:
    dag = DAG("branch")
    dag.task("pick", "t", branch=True)
    dag.task("a", "t", upstream=["pick"])
    dag.task("b", "t", upstream=["pick"])
    dag.task("b2", "t", upstream=["b"])
    dag.task("c", "t", upstream=["pick", "a"])  # reachable from the followed "a": not skipped
    dag.task("join", "t", upstream=["a", "b2"], trigger_rule="none_failed_min_one_success")
    d = drive(orc, dag, lambda k, kw, up: "a" if k == "pick" else None)
    states = d.states()
    assert states == {"pick": "SUCCEEDED", "a": "SUCCEEDED", "b": "SKIPPED", "b2": "SKIPPED", "c": "SUCCEEDED",
                      "join": "SUCCEEDED"}  # fmt: skip
    assert orc.task(d.run_id, "b").skip_reason == "branch_not_taken"
    assert orc.task(d.run_id, "b2").skip_reason == "upstream_skipped"
    d = drive(orc, dag, lambda k, kw, up: ["a", "b"] if k == "pick" else None)
    assert set(d.states().values()) == {"SUCCEEDED"}


@pytest.mark.parametrize("result", ["nope", ["a", "zzz"], 3, [1]])
def test_a_branch_naming_no_direct_child_fails_with_a_branch_error(orc: Orchestrator, result: Any) -> None:
    dag = DAG("branch-bad")
    dag.task("pick", "t", branch=True)
    dag.task("a", "t", upstream=["pick"])
    d = drive(orc, dag, lambda k, kw, up: result)
    pick = orc.task(d.run_id, "pick")
    assert pick.state.value == "FAILED" and (pick.error or "").startswith("BranchError: ")
    assert d.states()["a"] == "UPSTREAM_FAILED"


def test_a_join_below_a_branch_that_keeps_all_success_is_warned_about(orc: Orchestrator) -> None:
    dag = DAG("lint")
    dag.task("pick", "t", branch=True)
    dag.task("a", "t", upstream=["pick"])
    dag.task("b", "t", upstream=["pick"])
    dag.task("join", "t", upstream=["a", "b"])
    handle = orc.submit(dag)
    assert len(handle.warnings) == 1 and "'join' joins branches of 'pick'" in handle.warnings[0]


@pytest.mark.parametrize(("result", "skipped"), [(0, True), ([], True), ("", True), (None, True), ({"k": 1}, False)])
def test_a_short_circuit_skips_everything_downstream_on_a_falsy_result(
    orc: Orchestrator, result: Any, skipped: bool
) -> None:
    dag = DAG("short")
    dag.task("check", "t", short_circuit=True)
    dag.task("a", "t", upstream=["check"])
    dag.task("cleanup", "t", upstream=["a"], trigger_rule="all_done")
    dag.task("other", "t")
    d = drive(orc, dag, lambda k, kw, up: result if k == "check" else 1)
    states = d.states()
    if skipped:
        assert states == {"check": "SUCCEEDED", "a": "SKIPPED", "cleanup": "SKIPPED", "other": "SUCCEEDED"}
        assert orc.task(d.run_id, "cleanup").skip_reason == "short_circuit"
    else:
        assert set(states.values()) == {"SUCCEEDED"}
    assert d.run_state() == "SUCCEEDED"


def test_a_task_raising_skip_is_skipped_and_its_children_follow_their_rules(orc: Orchestrator) -> None:
    dag = DAG("skip")
    dag.task("a", "t", max_attempts=3)
    dag.task("b", "t", upstream=["a"])
    dag.task("c", "t", upstream=["a"], trigger_rule="none_skipped")
    dag.task("d", "t", upstream=["a"], trigger_rule="all_skipped")

    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        if key == "a":
            raise Skip("no new files")
        return 1

    d = drive(orc, dag, body)
    assert d.states() == {"a": "SKIPPED", "b": "SKIPPED", "c": "SKIPPED", "d": "SUCCEEDED"}
    assert [k for k, _, _ in d.ran].count("a") == 1  # never retried
    event = next(e for e in orc.ledger(d.run_id) if e.key == "a" and e.to_state == "SKIPPED")
    assert event.reason == "user: no new files"
    assert orc.task(d.run_id, "a").skip_reason == "user" and d.run_state() == "SUCCEEDED"


def test_setup_and_teardown(orc: Orchestrator) -> None:
    dag = DAG("setup")
    dag.task("create", "t", setup=True)
    dag.task("work", "t", upstream=["create"])
    dag.task("delete", "t", upstream=["create", "work"], teardown=True)
    failing = {"work"}

    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        if key in failing:
            raise Fail(key)
        return 1

    d = drive(orc, dag, body)
    assert d.states() == {"create": "SUCCEEDED", "work": "FAILED", "delete": "SUCCEEDED"}
    assert orc.task(d.run_id, "delete").trigger_rule == "all_done_setup_success"
    assert d.run_state() == "FAILED"  # the work failed
    failing.clear()
    failing.add("delete")
    d = drive(orc, dag, body)
    assert d.states()["delete"] == "FAILED" and d.run_state() == "SUCCEEDED"  # a teardown does not decide the run
    failing.clear()
    failing.add("create")
    d = drive(orc, dag, body)
    assert d.states() == {"create": "FAILED", "work": "UPSTREAM_FAILED", "delete": "UPSTREAM_FAILED"}
    strict = DAG("setup-strict")
    strict.task("create", "t", setup=True)
    strict.task("delete", "t", upstream=["create"], teardown=True, fails_run=True)
    failing.clear()
    failing.add("delete")
    assert drive(orc, strict, body).run_state() == "FAILED"


def test_always_starts_with_the_run(orc: Orchestrator) -> None:
    dag = DAG("always")
    dag.task("slow", "t")
    dag.task("watch", "t", upstream=["slow"], trigger_rule="always")
    handle = orc.submit(dag)
    assert orc.task(handle.id, "watch").state.value in ("READY", "QUEUED")


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda d: d.map("m", "t", over="ls", kwarg="x", trigger_rule="always"),
            "trigger_rule always on a node mapped",
        ),
        (lambda d: d.map("m", "t", over={"a": "ls", "b": [1]}), "several mapped arguments need combine"),
        (lambda d: d.map("m", "t", over="ls", kwarg="x", max_map_length=100_001), "max_map_length must be"),
        (lambda d: d.map("m", "t", over="ls", kwarg="x", on_empty="fail"), "on_empty must be"),
        (lambda d: d.map("m", "t", over="ls", kwarg="upstream"), "reserved"),
        (lambda d: d.map("m", "t", over="ls", kwarg="x", kwargs={"x": 1}), "also a constant kwarg"),
        (lambda d: d.map("m", "t", over="ls", kwarg="x", branch=True), "cannot be a branch"),
        (lambda d: d.map("m", "t", over=list(range(11)), kwarg="x", max_map_length=10), "exceed max_map_length"),
        (lambda d: d.task("m", "t", upstream=["ls"], branch=True, short_circuit=True), "not both"),
        (lambda d: d.task("m", "t", upstream=["ls"], fails_run=True), "teardown's option"),
        (lambda d: d.task("m", "t", upstream=["ls"], min_success_ratio=1.5), "min_success_ratio must be"),
        (lambda d: d.task("m", "t", upstream=["ls"], min_success_ratio=0.5, trigger_rule="all_done"), "relaxes"),
        (lambda d: d.task("m", "t", upstream=["ls"], trigger_rule="all_sucess"), "trigger_rule"),
    ],
)
def test_combinations_that_cannot_mean_anything_are_refused_before_anything_is_written(
    orc: Orchestrator, build: Any, message: str
) -> None:
    dag = DAG("refused")
    dag.task("ls", "t")
    with pytest.raises(ValidationError, match=message):
        build(dag)
        orc.submit(dag)
    assert orc.store.reads.list_runs(10) == []


def test_a_chained_map_with_another_upstream_is_refused(orc: Orchestrator) -> None:
    dag = DAG("chain-refused")
    dag.task("ls", "t")
    dag.task("other", "t")
    dag.map("s1", "t", over="ls", kwarg="x")
    dag.map("s2", "t", over="s1", kwarg="y", upstream=["other"])
    with pytest.raises(ValidationError, match="only upstream"):
        orc.submit(dag)


def test_the_spec_format_describes_maps_and_branches(orc: Orchestrator) -> None:
    from orchestrator.core.dag import dag_from_spec

    spec = {
        "name": "spec",
        "nodes": [
            {"key": "ls", "task": "t"},
            {"key": "m", "task": "t", "map": {"over": "ls", "kwarg": "x", "max_active": 2}},
            {"key": "pick", "task": "t", "upstream": ["m"], "branch": True},
            {"key": "a", "task": "up", "upstream": ["pick"]},
            {"key": "b", "task": "t", "upstream": ["pick"]},
        ],
    }
    dag = dag_from_spec(spec)
    assert dag_from_spec(dag.to_spec()).to_spec() == dag.to_spec()
    d = drive(orc, dag, lambda k, kw, up: [1, 2] if k == "ls" else "a" if k == "pick" else up)
    assert d.states()["b"] == "SKIPPED" and d.ran[-1] == ("a", {}, {"pick": "a"})


def test_a_map_wider_than_its_window_inserts_its_children_window_by_window(
    orc: Orchestrator, monkeypatch: pytest.MonkeyPatch
) -> None:
    import orchestrator.core.dag.bounds

    monkeypatch.setattr(orchestrator.core.dag.bounds, "MAP_WINDOW", 4)
    dag = DAG("windows")
    dag.task("ls", "t")
    dag.map("m", "t", over="ls", kwarg="x")
    dag.map("m2", "t", over="m", kwarg="y")
    dag.task("join", "up", upstream=["m2"])
    inserted: list[int] = []

    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        if key == "ls":
            return list(range(10))
        if key.startswith("m["):
            inserted.append(sum(1 for t in orc.tasks(d_run[0]) if t.map_parent == "m"))
            return kw["x"]
        return kw["y"] * 2 if key.startswith("m2[") else up

    d_run = [orc.submit(dag).id]
    d = drive(orc, dag, body, run_id=d_run[0])
    assert d.run_state() == "SUCCEEDED"
    assert d.ran[-1] == ("join", {}, {"m2": [2 * i for i in range(10)]})
    assert inserted[0] == 4 and max(inserted) == 10 and inserted != sorted(set(inserted))  # windows, not all at once
    header = orc.task(d.run_id, "m")
    assert header.map_counts == {"total": 10, "done": 10, "succeeded": 10, "failed": 0, "skipped": 0}
    assert orc.run(d.run_id).status().task_count == 4 + 20
    assert check_runs(orc.store, [d.run_id]) == []


def test_a_dead_lettered_child_holds_its_map_open_until_an_operator_resolves_it(orc: Orchestrator) -> None:
    dag = DAG("dead")
    dag.task("ls", "t")
    dag.map("m", "t", over="ls", kwarg="x", max_attempts=5)
    dag.task("join", "up", upstream=["m"], trigger_rule="all_done")
    d = drive(orc, dag, listing([1, 2]), until=lambda dr: dr.states().get("m[1]") == "QUEUED")
    store = orc.store
    for attempt in (1, 2):  # the same failure twice in a row: poison (ORCHESTRATOR_POISON_THRESHOLD=2)
        task = orc.task(d.run_id, "m[1]")
        if task.state.value == "RETRYING":
            store.recovery.release_due_retries()
            with store.engine.begin() as conn:  # its backoff is not the point here
                conn.exec_driver_sql("UPDATE orc_tasks SET not_before = now() WHERE key = 'm[1]'")
            store.recovery.release_due_retries()
        store.admission.admit_ready(100)
        assert store.attempts.claim(d.run_id, "m[1]", attempt, "w:1", 60.0, "t") is not None
        store.attempts.fail(d.run_id, "m[1]", attempt, error="boom", window=100, fingerprint="same")
    d = drive(orc, dag, listing([1, 2]), run_id=d.run_id)
    assert d.states()["m[1]"] == "DEAD_LETTER" and d.states()["m"] == "MAPPED" and d.states()["join"] == "PENDING"
    orc.skip_task(d.run_id, "m[1]", by="tester")
    d = drive(orc, dag, listing([1, 2]), run_id=d.run_id)
    assert d.states()["m"] == "SUCCEEDED" and d.states()["join"] == "SUCCEEDED" and d.run_state() == "SUCCEEDED"
    assert d.ran[-1] == ("join", {}, {"m": [2]})
