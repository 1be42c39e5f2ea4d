"""Task groups folded in the drawing: the tasks of a closed group (``DAG.group``; a key
``section_1.normal`` lies in the group ``section_1``) are drawn as one box counting them by state,
Airflow's collapsed task group. A group is closed unless it is named among the open ones (its
outermost closed group takes a key: opening ``section_2`` shows ``section_2.inner`` folded).

The graph is contracted before the layout (:func:`fold`): a closed group becomes one vertex named
``<group>.`` (no key ends with a dot), its edges those of its tasks to tasks outside it, so the
rest of the layout (:func:`.skeleton.structure`) is unchanged. A group whose tasks reach each
other through a task outside it folds into a cycle; the layout then places it where the walk
left it (every arrow still drawn)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

#: a folded group's box id: this prefix and the group's full name
GROUP_BOX = "group-"


@dataclass(frozen=True)
class Folded:
    """The graph with its closed groups contracted: the vertices (keys, and ``<group>.`` for a
    closed group), the keys each group vertex stands for, and the edges between vertices."""

    vertices: list[str]
    members: dict[str, tuple[str, ...]]
    edges: list[tuple[str, str]]


def closed_group(key: str, open_groups: Collection[str]) -> str | None:
    """The outermost group of ``key`` that is not open (``None``: the key is drawn itself)."""
    base = key.split("[", 1)[0]
    parts = base.split(".")
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        if name not in open_groups:
            return name
    return None


def fold(keys: Sequence[str], edges: Sequence[tuple[str, str]], open_groups: Collection[str] | None) -> Folded:
    """``keys`` and ``edges`` with every closed group contracted to one vertex; ``open_groups``
    ``None``: none is closed (every task drawn)."""
    if open_groups is None or not any("." in k for k in keys):
        return Folded(sorted(set(keys)), {}, list(edges))
    vertex: dict[str, str] = {}
    members: dict[str, list[str]] = {}
    for key in keys:
        group = closed_group(key, open_groups)
        if group is None:
            vertex[key] = key
        else:
            vertex[key] = group + "."
            members.setdefault(group + ".", []).append(key)
    seen: set[tuple[str, str]] = set()
    out: list[tuple[str, str]] = []
    for p, c in edges:
        a, b = vertex.get(p), vertex.get(c)
        if a is not None and b is not None and a != b and (a, b) not in seen:
            seen.add((a, b))
            out.append((a, b))
    return Folded(sorted(set(vertex.values())), {v: tuple(sorted(ks)) for v, ks in members.items()}, out)


def group_box_id(vertex: str) -> str:
    """A folded group's box id (``group-section_1``): the same whichever other groups are open,
    so a page that opened one can still be told the others' counts."""
    return GROUP_BOX + vertex.rstrip(".")


def arrow_labels(
    labels: dict[tuple[str, str], str] | None, box_of: dict[str, str], arrows: Collection[tuple[str, str]]
) -> dict[tuple[str, str], str]:
    """Edge labels (``(parent key, child key)``) on the drawn arrows (``(box id, box id)``): the
    labels of the edges an arrow stands for, each text once, joined with ``", "``."""
    out: dict[tuple[str, str], list[str]] = {}
    for (p, c), text in (labels or {}).items():
        arrow = (box_of.get(p, ""), box_of.get(c, ""))
        if arrow in arrows and text not in out.setdefault(arrow, []):
            out[arrow].append(text)
    return {a: ", ".join(texts) for a, texts in sorted(out.items())}
