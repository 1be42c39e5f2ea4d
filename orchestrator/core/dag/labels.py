"""Edge labels (Airflow's ``Label``: ``check >> Label("valid") >> load``): a short text on the
arrow from a parent to a child, written with :meth:`DAG.label` (or the spec's top-level
``labels``). A label names an edge that exists: the child lists the parent in its upstream. It
changes nothing in how the run goes; the spec carries it (the run's stored snapshot, so the run
page and ``orchestrator runs graph`` draw it on the arrow)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import SpecError, ValidationError
from .bounds import text_problem

#: the longest label (characters)
MAX_LABEL_CHARS = 100


def add_label(dag: Any, parent: Any, child: Any, text: Any) -> list[tuple[str, str]]:
    """Label the edges from ``parent`` to ``child`` of ``dag`` (each a node, a node's key, a key
    resolved in the open task groups, or a group: its leaves as the parent, its roots as the
    child) with ``text``, and return them. Raises :class:`ValidationError` when no such edge
    exists or the text is not a short one-line string."""
    problem = text_problem(text, MAX_LABEL_CHARS)
    if problem:
        raise ValidationError(f"an edge label {problem}", dag=dag.name)
    parents = dag.upstream_keys([parent], None)
    children = _children(dag, child)
    edges = [(p, c) for c in children for p in parents if p in dag.nodes[c].upstream]
    if not edges:
        raise ValidationError(
            f"no edge from {', '.join(parents)} to {', '.join(children)} to label: add the child with the parent"
            " in its upstream first",
            dag=dag.name,
        )
    for edge in edges:
        dag.labels[edge] = text
    return edges


def _children(dag: Any, child: Any) -> list[str]:
    """A label's child as node keys: a group's roots, or the one node (which must exist)."""
    roots = getattr(child, "roots", None)
    if callable(roots) and hasattr(child, "keys"):
        return [str(k) for k in roots()]
    keys: list[str] = dag.upstream_keys([child], None)
    missing = [k for k in keys if k not in dag.nodes]
    if missing:
        raise ValidationError(f"an edge label names the unknown node {missing[0]!r}", dag=dag.name)
    return keys


def labels_to_spec(labels: Mapping[tuple[str, str], str]) -> list[dict[str, str]]:
    """The spec's ``labels``: ``[{"from": parent, "to": child, "label": text}, ...]``."""
    return [{"from": p, "to": c, "label": text} for (p, c), text in labels.items()]


def labels_from_spec(dag: Any, raw: Any) -> None:
    """Add a spec's ``labels`` to ``dag`` (its nodes already added). Raises :class:`SpecError`
    for a wrong shape, :class:`ValidationError` for a label of no edge."""
    if not isinstance(raw, list):
        raise SpecError("'labels' must be a list of {from, to, label}", dag=dag.name)
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping) or set(item) != {"from", "to", "label"}:
            raise SpecError(f"labels[{i}] must be a mapping of exactly from, to and label", dag=dag.name)
        if not isinstance(item["from"], str) or not isinstance(item["to"], str):
            raise SpecError(f"labels[{i}]: from and to must be node keys", dag=dag.name)
        if item["from"] not in dag.nodes or item["to"] not in dag.nodes:
            raise SpecError(f"labels[{i}] names a node the DAG does not have", dag=dag.name)
        add_label(dag, item["from"], item["to"], item["label"])


def edge_labels(snapshot: Any) -> dict[tuple[str, str], str]:
    """The labels of a run's stored DAG snapshot (``to_spec``), by ``(parent, child)``; a
    malformed entry is left out (the drawing never fails on one)."""
    raw = snapshot.get("labels") if isinstance(snapshot, Mapping) else None
    out: dict[tuple[str, str], str] = {}
    for item in raw if isinstance(raw, list) else []:
        if isinstance(item, Mapping) and all(isinstance(item.get(f), str) for f in ("from", "to", "label")):
            out[(item["from"], item["to"])] = item["label"]
    return out
