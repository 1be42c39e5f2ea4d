"""Task groups (Airflow's ``TaskGroup``): ``with dag.group("section_1"):`` prefixes the keys of the
nodes added inside it (``section_1.normal``; nested groups ``outer.inner.task``), lends them its
defaults for the options they leave at theirs (a rule, attempts, a pool...), resolves a bare key
of the same group in ``upstream`` and, given ``upstream=``, makes the group's roots (its nodes with
no parent inside it) follow those nodes (Airflow's ``task >> group``). A group in another node's
``upstream`` stands for its leaves: its nodes with no child inside it, a teardown left out
(Airflow's ``group >> task``). A group is a naming and authoring aid: the run holds the prefixed
keys, and the run page and ``explain`` fold a group's tasks into one line by the prefix."""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ValidationError
from .model import Node

#: one segment of a group's name (its full name joins the segments with '.')
GROUP_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: the options a group lends its nodes (each taken where the node leaves the option at its default)
GROUP_OPTIONS = frozenset({
    "trigger_rule", "max_attempts", "backoff", "soft_time_limit", "time_limit", "priority", "queue", "retry_on",
    "no_retry_on", "pool", "pool_slots", "rate_limit", "resources", "deadline",
})  # fmt: skip


@dataclass
class TaskGroup:
    """A group of a DAG's nodes (``DAG.group``): its full dotted ``name``, the ``defaults`` its
    nodes take, the nodes it lends ``upstream`` to when they have no parent inside it, and the
    keys added inside it (nested groups' included), in order."""

    #: the :class:`~.authoring.DAG` it belongs to (not imported: the DAG module imports this one)
    dag: Any
    name: str
    defaults: dict[str, Any] = field(default_factory=dict)
    upstream: tuple[str, ...] = ()
    keys: list[str] = field(default_factory=list)

    def __enter__(self) -> TaskGroup:
        self.dag._groups.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.dag._groups.pop()

    def key_of(self, key: str) -> str:
        """The full key of a node added inside the group."""
        return f"{self.name}.{key}"

    def roots(self) -> list[str]:
        """The group's nodes with no parent inside it."""
        inside = set(self.keys)
        return [k for k in self.keys if not inside.intersection(self.dag.nodes[k].upstream)]

    def leaves(self) -> list[str]:
        """The group's nodes with no child inside it, a teardown left out (its work before it
        stands in: Airflow's leaves of a group)."""
        inside = set(self.keys)
        has_child = {p for k in self.keys for p in self.dag.nodes[k].upstream if p in inside}
        found: list[str] = []
        todo = [k for k in self.keys if k not in has_child]
        seen = set(todo)
        while todo:
            node = self.dag.nodes[todo.pop(0)]
            if not node.teardown:
                found.append(node.key)
                continue
            for up in node.upstream:
                if up in inside and up not in seen and not self.dag.nodes[up].setup:
                    seen.add(up)
                    todo.append(up)
        return sorted(found, key=self.keys.index)


def new_group(dag: Any, name: Any, upstream: Iterable[Any], defaults: dict[str, Any]) -> TaskGroup:
    """A group named ``name`` inside the innermost open group of ``dag`` (or at its top), its
    defaults laid over the outer group's. Raises :class:`ValidationError` naming the problem."""
    if not isinstance(name, str) or not GROUP_NAME_RE.fullmatch(name):
        raise ValidationError(
            f"group name {name!r} must be 1-64 letters, digits, '_' or '-' (nested groups make the dots)",
            dag=dag.name,
        )
    bad = sorted(set(defaults) - GROUP_OPTIONS)
    if bad:
        raise ValidationError(
            f"a group lends its nodes only {', '.join(sorted(GROUP_OPTIONS))}, not {', '.join(bad)}", dag=dag.name
        )
    outer = dag._groups[-1] if dag._groups else None
    full = name if outer is None else outer.key_of(name)
    if full in dag.groups:
        raise ValidationError(f"group {full!r} is opened twice: add to it inside one with-block", dag=dag.name)
    if any(k == full or k.startswith(full + ".") or full.startswith(k + ".") for k in dag.nodes):
        raise ValidationError(f"group {full!r} clashes with a node key of the DAG", dag=dag.name)
    ups = tuple(dag.upstream_keys(upstream, None))
    group = TaskGroup(dag, full, {**(outer.defaults if outer else {}), **defaults}, ups)
    dag.groups[full] = group
    return group


#: the options :func:`lend` takes and returns, in order
LENT = ("trigger_rule", "max_attempts", "backoff", "soft_time_limit", "time_limit", "priority", "queue", "retry_on",
        "no_retry_on", "pool", "pool_slots", "rate_limit", "resources", "deadline")  # fmt: skip


def lend(group: TaskGroup, own_rule: bool, *given: Any) -> tuple[Any, ...]:
    """A :meth:`DAG.task` call's options (in :data:`LENT`'s order) with the group's defaults where
    the call left an option at the method's own default (``own_rule``: a setup or teardown keeps
    its rule)."""
    defaults = task_defaults(group.dag.__class__.task)
    out = list(given)
    for i, name in enumerate(LENT):
        if name in group.defaults and out[i] == defaults[name] and not (own_rule and name == "trigger_rule"):
            out[i] = group.defaults[name]
    return tuple(out)


@functools.cache
def task_defaults(method: Any) -> dict[str, Any]:
    """``DAG.task``'s own defaults of the options a group may lend."""
    params = inspect.signature(method).parameters.values()
    return {p.name: p.default for p in params if p.name in GROUP_OPTIONS}


def with_group_upstream(open_groups: list[TaskGroup], parents: list[str]) -> list[str]:
    """A new node's parents with the upstream of each open group it is a root of (no parent
    inside the group): Airflow's ``task >> group``."""
    for group in reversed(open_groups):
        if group.upstream and not set(group.keys).intersection(parents):
            parents = parents + [u for u in group.upstream if u not in parents]
    return parents


def groups_of(key: str) -> list[str]:
    """The groups a node key lies in, outermost first (``a.b.c`` -> ``a``, ``a.b``)."""
    base = key.split("[", 1)[0]
    parts = base.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def group_rows(keys: Iterable[str], states: dict[str, str]) -> dict[str, dict[str, int]]:
    """Each group's task count by state (a map child counted in its map's group)."""
    out: dict[str, dict[str, int]] = {}
    for key in keys:
        for g in groups_of(key):
            counts = out.setdefault(g, {})
            counts[states[key]] = counts.get(states[key], 0) + 1
    return out


def touch(group: TaskGroup | None, node: Node) -> None:
    """Record ``node`` in ``group`` and in every group around it."""
    while group is not None:
        group.keys.append(node.key)
        outer = group.name.rsplit(".", 1)[0] if "." in group.name else None
        group = group.dag.groups.get(outer) if outer is not None else None
