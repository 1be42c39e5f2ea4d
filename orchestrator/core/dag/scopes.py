"""Airflow's setup scope and the leaves that decide a run, computed at submit.

The setup scope: the setups a task works under without being their child
(``BaseOperator.get_upstreams_only_setups``: a setup upstream of the task that has no teardown,
or has one downstream of the task), which decide it beside its trigger rule
(``_evaluate_setup_constraint``: one that failed makes it UPSTREAM_FAILED, one skipped SKIPPED,
and it waits until they are all done). A teardown has no such scope; a direct parent that is a
setup counts through the trigger rule as any parent does. The store writes the result as
``orc_tasks.setup_scope`` (and, on each setup, ``scope_of``). The leaves: ``run_state="leaves"``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol


class _Node(Protocol):
    @property
    def key(self) -> str: ...
    @property
    def upstream(self) -> Sequence[str]: ...
    @property
    def setup(self) -> bool: ...
    @property
    def teardown(self) -> bool: ...


def setup_scopes(nodes: Mapping[str, _Node]) -> dict[str, list[str]]:
    """Each task's indirect setups (sorted), for the tasks that have any: for every setup, the
    tasks below it that are not its children, not teardowns, and lie above one of its teardowns
    (all of them when it has none). One walk down and one up per setup: a DAG without setups
    costs one pass over its nodes."""
    setups = [n for n in nodes.values() if n.setup]
    if not setups:
        return {}
    children: dict[str, list[str]] = {}
    for node in nodes.values():
        for parent in node.upstream:
            children.setdefault(parent, []).append(node.key)
    scopes: dict[str, list[str]] = {}
    for setup in setups:
        below = _walk([setup.key], children)
        direct = set(children.get(setup.key, []))
        teardowns = [k for k in direct if nodes[k].teardown]
        above_teardowns = _walk(teardowns, {k: list(nodes[k].upstream) for k in nodes}) if teardowns else None
        for key in below:
            node = nodes[key]
            if key in direct or node.teardown or (above_teardowns is not None and key not in above_teardowns):
                continue
            scopes.setdefault(key, []).append(setup.key)
    return {k: sorted(v) for k, v in scopes.items()}


def _walk(start: Sequence[str], links: Mapping[str, Sequence[str]]) -> set[str]:
    """Every key reachable from ``start`` by ``links``, ``start`` not included."""
    seen: set[str] = set()
    todo = list(start)
    while todo:
        for nxt in links.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen - set(start)


def leaf_deciders(nodes: Mapping[str, _Node]) -> set[str]:
    """The nodes whose failure fails a ``run_state="leaves"`` run: the leaves, a teardown leaf
    without ``fails_run`` replaced by the nodes above it (Airflow's ``_tis_for_dagrun_state``)."""
    parents = {p for node in nodes.values() for p in node.upstream}
    found: set[str] = set()
    todo = [k for k in nodes if k not in parents]
    seen = set(todo)
    while todo:
        node = nodes[todo.pop()]
        if not (node.teardown and not getattr(node, "fails_run", False)):
            found.add(node.key)
            continue
        for up in node.upstream:
            if up not in seen:
                seen.add(up)
                todo.append(up)
    return found
