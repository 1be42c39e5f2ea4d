"""Striped fan-ins (issue 35): a wide join counts its parents' arrivals over several rows.

Without stripes every parent's end updates the join's counters and the run's open count: two
rows that every completion of a 1 -> 10,000 -> 1 fan-out writes, one after the other, each under
its row lock. With them, the join's plain parents are dealt round robin over ``stripes`` rows of
``orc_stripes`` at submit (each with its ``quota`` of parents); a parent's success only counts
into its stripe, and the arrival that fills a stripe adds the stripe's successes to the join's
counters and takes them off the run's open count, in the same transaction (``orc_settle_v4``).
So the join's row and the run's row are written once per stripe, not once per parent.

What keeps a decision exact: a parent that did not succeed (FAILED, UPSTREAM_FAILED, SKIPPED)
is counted into the join at once, and only joins whose rule no success can decide before every
parent is done are striped (:data:`STRIPED_RULES`): a success held in its stripe can delay no
verdict. A task that is not plain (a map, a branch, a short circuit, a setup or teardown, a wait,
a sensor, a transactional task) or that has another child is never striped; nor is a join with a
setup scope or a map. The run stays open while a stripe holds a success: its last parent
arrives in every run that is not cancelled.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.engine import Connection

from ..core.dag import DAG, Node
from ..core.dag.scopes import setup_scopes
from ..core.states import TriggerRule
from . import schema as s

#: the default number of stripes of a wide fan-in (``ORCHESTRATOR_FANIN_STRIPES``; 0: none)
FANIN_STRIPES = 16
#: a join is striped when it has at least this many plain parents per stripe
PARENTS_PER_STRIPE = 4
#: the trigger rules that no success decides before every parent is done (``orc_decide_v2``):
#: all_success (with or without min_success_ratio) waits for every success, the others for done
#: = total, and their early verdicts come from failures and skips, which are never held
STRIPED_RULES = frozenset(
    {
        TriggerRule.ALL_SUCCESS,
        TriggerRule.ALL_DONE,
        TriggerRule.ALL_DONE_MIN_ONE_SUCCESS,
        TriggerRule.NONE_FAILED,
        TriggerRule.NONE_FAILED_MIN_ONE_SUCCESS,
        TriggerRule.NONE_SKIPPED,
        TriggerRule.ONE_FAILED,
    }
)


@dataclass
class Striped:
    """A run's striped fan-ins: ``of`` maps a parent to its stripe, ``quotas`` a join to the
    number of parents of each of its stripes."""

    of: dict[str, int] = field(default_factory=dict)
    quotas: dict[str, list[int]] = field(default_factory=dict)

    def rows(self, run_id: str) -> Iterator[dict[str, Any]]:
        """The ``orc_stripes`` rows of the run."""
        for join, quotas in self.quotas.items():
            for stripe, quota in enumerate(quotas):
                yield {"run_id": run_id, "key": join, "stripe": stripe, "quota": quota, "arrived": 0,
                       "pending": 0, "folded": 0}  # fmt: skip


def _plain(node: Node) -> bool:
    """A task whose end is a plain count: no map, branch, short circuit, setup or teardown,
    wait, sensor, transaction or success ratio."""
    return not (
        node.map is not None
        or node.branch
        or node.short_circuit
        or node.setup
        or node.teardown
        or node.min_success_ratio is not None
        or node.wait is not None
        or node.sensor is not None
        or node.transactional
        or node.child is not None
    )


def fan_in_stripes(dag: DAG, stripes: int) -> Striped:
    """Which joins of ``dag`` are striped and how (``stripes`` per join; 0: none). A DAG with no
    wide join costs one look at each node's upstream count."""
    out = Striped()
    need = stripes * PARENTS_PER_STRIPE
    joins = [
        j for j in dag.nodes.values()
        if stripes > 0 and len(j.upstream) >= need and j.trigger_rule in STRIPED_RULES and j.map is None
    ]  # fmt: skip
    if not joins:
        return out
    children: dict[str, int] = {}
    for node in dag.nodes.values():
        for parent in node.upstream:
            children[parent] = children.get(parent, 0) + 1
    scoped = setup_scopes(dag.nodes) if any(n.setup for n in dag.nodes.values()) else {}
    for join in joins:
        parents = [p for p in join.upstream if children[p] == 1 and _plain(dag.nodes[p])]
        if scoped.get(join.key) or len(parents) < need:
            continue
        quotas = [0] * stripes
        for i, parent in enumerate(parents):
            out.of[parent] = i % stripes
            quotas[i % stripes] += 1
        out.quotas[join.key] = quotas
    return out


def take_back(conn: Connection, run_id: str, stripe: int | None, children: list[str]) -> None:
    """A striped parent that ended FAILED goes back to be run (a manual retry): its arrival is
    taken out of its stripe, so the stripe fills again when it ends again (the join's counters
    are taken back by the caller, as for any parent: a failure was counted into them at once)."""
    if stripe is None or not children:
        return
    t = s.stripes
    conn.execute(
        t.update()
        .where(t.c.run_id == run_id, t.c.key.in_(children), t.c.stripe == stripe)
        .values(arrived=t.c.arrived - 1)
    )
