"""Airflow's 13 trigger rules: the one implementation (``orc_decide_v2``, ``store/sql/decide.sql``)
against a Python statement of Airflow's table, for every combination of up to three parents'
states (setup parents included) and for mapped parents (the counts of a map's children).

:func:`airflow_verdict` follows ``airflow-core/src/airflow/ti_deps/deps/trigger_rule_dep.py``
(``_evaluate_direct_relatives``) step by step: first the early verdict Airflow sets with
``flag_upstream_failed`` (SKIPPED or UPSTREAM_FAILED, possibly before every parent is done),
then whether the rule is met (READY). No ``removed`` state exists here (a cleared map's old
children are never counted), so its terms are 0.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import sqlalchemy as sa

from orchestrator.core.states import TriggerRule
from orchestrator.store import Store

pytestmark = pytest.mark.postgres
R = TriggerRule

#: a parent's state as the counters see it: None while it is not done
PARENT_STATES = (None, "SUCCEEDED", "FAILED", "UPSTREAM_FAILED", "SKIPPED")


@dataclass(frozen=True)
class Counts:
    upstream: int
    success: int = 0
    failed: int = 0
    upstream_failed: int = 0
    skipped: int = 0
    upstream_setup: int = 0
    success_setup: int = 0
    skipped_setup: int = 0

    @property
    def done(self) -> int:
        return self.success + self.failed + self.upstream_failed + self.skipped


def airflow_verdict(rule: TriggerRule, c: Counts, ratio: float | None = None) -> str | None:
    """READY, SKIPPED, UPSTREAM_FAILED or None (not decided yet), as Airflow decides."""
    upstream, success, failed, upstream_failed, skipped = c.upstream, c.success, c.failed, c.upstream_failed, c.skipped
    done = c.done
    upstream_done = done >= upstream
    if rule is R.ALWAYS:
        return "READY"
    if ratio is not None:
        # our extension of all_success (min_success_ratio): READY once ceil(ratio x upstream)
        # succeeded and every parent is done; decided early once that many can no longer succeed
        need = math.ceil(ratio * upstream)
        if upstream_done and success >= need:
            return "READY"
        if upstream - (failed + upstream_failed + skipped) < need:
            return "UPSTREAM_FAILED" if failed + upstream_failed else "SKIPPED"
        return None
    new_state = None
    # flag_upstream_failed: the early verdicts
    if rule is R.ALL_SUCCESS:
        if upstream_failed or failed:
            new_state = "UPSTREAM_FAILED"
        elif skipped:
            new_state = "SKIPPED"
    elif rule is R.ALL_FAILED:
        if success or skipped:
            new_state = "SKIPPED"
    elif rule is R.ONE_SUCCESS:
        if upstream_done and done == skipped:
            new_state = "SKIPPED"
        elif upstream_done and success <= 0:
            new_state = "UPSTREAM_FAILED"
    elif rule is R.ONE_FAILED:
        if upstream_done and not (failed or upstream_failed):
            new_state = "SKIPPED"
    elif rule is R.ONE_DONE:
        if upstream_done and not (failed or success):
            new_state = "SKIPPED"
    elif rule is R.NONE_FAILED:
        if upstream_failed or failed:
            new_state = "UPSTREAM_FAILED"
    elif rule is R.NONE_FAILED_MIN_ONE_SUCCESS:
        if upstream_failed or failed:
            new_state = "UPSTREAM_FAILED"
        elif skipped == upstream:
            new_state = "SKIPPED"
    elif rule is R.NONE_SKIPPED:
        if skipped:
            new_state = "SKIPPED"
    elif rule is R.ALL_SKIPPED:
        if success or failed or upstream_failed:
            new_state = "SKIPPED"
    elif rule is R.ALL_DONE_MIN_ONE_SUCCESS:
        non_skipped_done = success + failed + upstream_failed
        non_skipped_upstream = upstream - skipped
        if skipped > 0:
            new_state = "SKIPPED"
        elif non_skipped_done >= non_skipped_upstream and success == 0:
            new_state = "UPSTREAM_FAILED"
    elif rule is R.ALL_DONE_SETUP_SUCCESS:
        if upstream_done and c.upstream_setup and c.skipped_setup >= c.upstream_setup:
            new_state = "SKIPPED"
        elif upstream_done and c.upstream_setup and c.success_setup == 0:
            new_state = "UPSTREAM_FAILED"
    if new_state is not None:
        return new_state
    # is the rule met?
    met = {
        R.ONE_SUCCESS: success > 0,
        R.ONE_FAILED: bool(failed or upstream_failed),
        R.ONE_DONE: success + failed > 0,
        R.ALL_SUCCESS: upstream - success <= 0,
        R.ALL_FAILED: upstream - failed - upstream_failed <= 0,
        R.ALL_DONE: upstream_done,
        R.NONE_FAILED: upstream - success - skipped <= 0,
        R.NONE_FAILED_MIN_ONE_SUCCESS: upstream - success - skipped <= 0,
        R.NONE_SKIPPED: upstream_done and skipped == 0,
        R.ALL_SKIPPED: upstream - skipped <= 0,
        R.ALL_DONE_SETUP_SUCCESS: upstream_done and not (c.upstream_setup and not c.success_setup),
        R.ALL_DONE_MIN_ONE_SUCCESS: skipped == 0 and success + failed + upstream_failed >= upstream and success > 0,
    }[rule]
    return "READY" if met else None


def parent_combinations(max_parents: int = 3) -> Iterator[Counts]:
    """Every combination of 1 to ``max_parents`` parents, each in every state, setup or not."""
    for n in range(1, max_parents + 1):
        for states in itertools.product(PARENT_STATES, repeat=n):
            for setups in itertools.product((False, True), repeat=n):
                yield Counts(
                    upstream=n,
                    success=states.count("SUCCEEDED"),
                    failed=states.count("FAILED"),
                    upstream_failed=states.count("UPSTREAM_FAILED"),
                    skipped=states.count("SKIPPED"),
                    upstream_setup=sum(setups),
                    success_setup=sum(1 for s, up in zip(states, setups, strict=True) if up and s == "SUCCEEDED"),
                    skipped_setup=sum(1 for s, up in zip(states, setups, strict=True) if up and s == "SKIPPED"),
                )


def mapped_combinations(max_children: int = 8) -> Iterator[Counts]:
    """A map's children as one parent each: every split of 1 to ``max_children`` children over
    not done, succeeded, failed, upstream-failed and skipped (plus an ordinary parent beside)."""
    for n in range(1, max_children + 1):
        for ok, failed, up_failed, skipped in itertools.product(range(n + 1), repeat=4):
            if ok + failed + up_failed + skipped <= n:
                yield Counts(n, ok, failed, up_failed, skipped)


def sql_verdicts(store: Store, cases: list[tuple[TriggerRule, Counts, float | None]]) -> list[str | None]:
    """``orc_decide_v2`` for every case, in one statement."""
    rows = [
        (rule.value, c.upstream, c.done, c.success, c.failed, c.upstream_failed, c.skipped, c.upstream_setup,
         c.success_setup, c.skipped_setup, ratio)
        for rule, c, ratio in cases
    ]  # fmt: skip
    query = sa.text(
        "SELECT orc_decide_v2(r, t, d, o, f, u, s, su, so, ss, q) FROM ROWS FROM (jsonb_to_recordset(CAST(:rows AS"
        " jsonb)) AS (r text, t int, d int, o int, f int, u int, s int, su int, so int, ss int, q float8))"
        " WITH ORDINALITY AS x(r, t, d, o, f, u, s, su, so, ss, q, n) ORDER BY n"
    )

    payload = json.dumps(
        [dict(zip(("r", "t", "d", "o", "f", "u", "s", "su", "so", "ss", "q"), r, strict=True)) for r in rows]
    )
    with store.engine.connect() as conn:
        return [row[0] for row in conn.execute(query, {"rows": payload})]


@pytest.fixture
def store(pg_url: str) -> Iterator[Store]:
    st = Store(pg_url)
    yield st
    st.dispose()


def _compare(store: Store, cases: list[tuple[TriggerRule, Counts, float | None]]) -> None:
    got = sql_verdicts(store, cases)
    wrong = [
        (rule.value, c, ratio, sql, airflow_verdict(rule, c, ratio))
        for (rule, c, ratio), sql in zip(cases, got, strict=True)
        if sql != airflow_verdict(rule, c, ratio)
    ]
    assert not wrong, f"{len(wrong)} of {len(cases)} differ, e.g. (rule, counts, ratio, sql, airflow): {wrong[:5]}"


def test_every_rule_for_every_state_of_up_to_three_parents(store: Store) -> None:
    cases = [(rule, c, None) for rule in R for c in parent_combinations()]
    assert len(cases) == 13 * sum((5 * 2) ** n for n in (1, 2, 3))
    _compare(store, cases)


def test_every_rule_over_a_maps_children(store: Store) -> None:
    cases = [(rule, c, None) for rule in R for c in mapped_combinations()]
    _compare(store, cases)


def test_min_success_ratio_over_a_maps_children(store: Store) -> None:
    cases = [(R.ALL_SUCCESS, c, ratio) for ratio in (0.5, 0.75, 0.9, 1.0) for c in mapped_combinations()]
    _compare(store, cases)


def test_every_rule_decides_once_every_parent_is_done() -> None:
    """Whatever the parents' outcomes, no rule leaves a task waiting once all are done."""
    for rule in R:
        for c in parent_combinations():
            if c.done == c.upstream:
                assert airflow_verdict(rule, c) is not None, (rule, c)


def test_early_verdicts_exist_and_are_airflows() -> None:
    """A few of Airflow's early verdicts, spelled out (the table above decides them all)."""
    assert airflow_verdict(R.ALL_SUCCESS, Counts(3, failed=1)) == "UPSTREAM_FAILED"
    assert airflow_verdict(R.ONE_SUCCESS, Counts(3, success=1)) == "READY"
    assert airflow_verdict(R.NONE_SKIPPED, Counts(3, skipped=1)) == "SKIPPED"
    assert airflow_verdict(R.ALL_SKIPPED, Counts(3, success=1)) == "SKIPPED"
    assert airflow_verdict(R.ONE_DONE, Counts(3, upstream_failed=3)) == "SKIPPED"  # upstream_failed is not "done"
    assert (
        airflow_verdict(R.ALL_DONE_SETUP_SUCCESS, Counts(2, failed=1, success=1, upstream_setup=1, success_setup=1))
        == "READY"
    )
