"""Where a run's DAG's boxes go: the layered layout, decided from the keys and the edges alone.

A task's layer is its longest path from a root, so every arrow points right; within a layer,
tasks are ordered by a few barycentre sweeps (the mean position of their neighbours), which
removes most crossings. A DAG with more than :data:`COLLAPSE_AT` tasks is drawn in counted
groups decided from its edges (:func:`structure`): a long chain is one box, a wide layer one box
per set of parents, and never more than :data:`MAX_BOXES` boxes and :data:`MAX_ARROWS` arrows.
A run's DAG never changes after submission, so a server may keep its :class:`Skeleton`.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from .fold import arrow_labels, fold, group_box_id

#: above this many tasks, chains and wide layers are drawn as counted groups (see :func:`structure`)
COLLAPSE_AT = 300
#: a layer of more boxes than this is grouped
WIDE_LAYER = 40
#: a chain of this many tasks or more is one box
CHAIN_MIN = 4
#: a wide layer is split into at most this many groups (by the boxes its tasks hang from)
GROUPS_PER_LAYER = 8
#: the most boxes and arrows drawn, whatever the DAG
MAX_BOXES = 800
MAX_ARROWS = 2000
BOX_W, BOX_H, GAP_X, GAP_Y, MARGIN = 170, 46, 60, 14, 16
K = TypeVar("K", str, int)


def layers(keys: Sequence[K], edges: Iterable[tuple[K, K]]) -> dict[K, int]:
    """Each key's layer: the length of its longest path from a root (Kahn's order)."""
    children: dict[K, list[K]] = {k: [] for k in keys}
    indegree = dict.fromkeys(keys, 0)
    for parent, child in edges:
        if parent in children and child in indegree:
            children[parent].append(child)
            indegree[child] += 1
    layer = dict.fromkeys(keys, 0)
    todo = [k for k in keys if indegree[k] == 0]
    while todo:
        key = todo.pop()
        for child in children[key]:
            layer[child] = max(layer[child], layer[key] + 1)
            indegree[child] -= 1
            if indegree[child] == 0:
                todo.append(child)
    return layer


def _order(by_layer: list[list[int]], parents: dict[int, list[int]], children: dict[int, list[int]]) -> None:
    """Barycentre sweeps, down then up, in place: fewer crossings, stable for ties."""
    for sweep in range(4):
        down = sweep % 2 == 0
        rng = range(1, len(by_layer)) if down else range(len(by_layer) - 2, -1, -1)
        for i in rng:
            ref = by_layer[i - 1] if down else by_layer[i + 1]
            pos = {k: n for n, k in enumerate(ref)}
            near = parents if down else children

            def centre(key: int, pos: dict[int, int] = pos, near: dict[int, list[int]] = near) -> float:
                seen = [pos[n] for n in near.get(key, ()) if n in pos]
                return sum(seen) / len(seen) if seen else float("inf")

            current = {k: n for n, k in enumerate(by_layer[i])}
            by_layer[i].sort(key=lambda k: (centre(k), current[k]))


@dataclass(frozen=True)
class Skeleton:
    """Where each box goes, states apart: what :func:`structure` decides from the keys and the
    edges alone (a run's DAG never changes after submission, so a server may keep it)."""

    #: (box id, kind, keys, x, y): kind ``task`` (one key), ``group`` (a folded task group),
    #: ``chain``, ``layer`` or ``band``
    boxes: list[tuple[str, str, tuple[str, ...], int, int]]
    arrows: list[tuple[str, str]]
    width: int
    height: int
    #: the box each key is drawn in
    box_of: dict[str, str]
    #: arrows left out (more than :data:`MAX_ARROWS`)
    hidden_arrows: int = 0
    #: the edges' labels on the drawn arrows (``(box id, box id)``: :func:`.fold.arrow_labels`)
    labels: dict[tuple[str, str], str] = field(default_factory=dict)


def _chains(n: int, parents: list[list[int]], children: list[list[int]]) -> list[list[int]]:
    """The DAG cut into maximal chains: runs of tasks where each link is a parent's only child
    and that child's only parent (a task on no such link is a chain of one). Linear work."""
    out: list[list[int]] = []
    for v in range(n):
        ups = parents[v]
        if len(ups) == 1 and len(children[ups[0]]) == 1:
            continue  # inside a chain: reached from its head
        chain = [v]
        while len(kids := children[v]) == 1 and len(parents[kids[0]]) == 1:
            v = kids[0]
            chain.append(v)
        out.append(chain)
    return out


def _int_layers(n: int, children: list[list[int]], indegree: list[int]) -> list[int]:
    """:func:`layers` over ``0..n-1`` with adjacency lists (the big DAGs' fast path)."""
    indegree = list(indegree)
    layer = [0] * n
    todo = [v for v in range(n) if indegree[v] == 0]
    while todo:
        v = todo.pop()
        nxt = layer[v] + 1
        for c in children[v]:
            if layer[c] < nxt:
                layer[c] = nxt
            indegree[c] -= 1
            if indegree[c] == 0:
                todo.append(c)
    return layer


def structure(
    keys: Sequence[str],
    edges: Sequence[tuple[str, str]],
    *,
    open_groups: Collection[str] | None = None,
    labels: dict[tuple[str, str], str] | None = None,
) -> Skeleton:
    """Decide the boxes from the graph's structure, with bounded work and output.

    ``open_groups`` ``None`` draws every task; a collection folds each task group not in it
    into one box (:mod:`.fold`: ``()`` folds every outermost group). ``labels`` are the edges'
    labels (``(parent key, child key)``), drawn on the arrows they fall on.

    Up to :data:`COLLAPSE_AT` tasks, every task is a box. Above it: a chain of
    :data:`CHAIN_MIN` or more tasks (each link a parent's only child and that child's only
    parent) becomes one box; a layer wider than :data:`WIDE_LAYER` boxes becomes one box per
    set of parent boxes its members hang from (one box for the layer when those sets are more
    than :data:`GROUPS_PER_LAYER`); if that still leaves more than :data:`MAX_BOXES` boxes,
    every layer becomes one box, then bands of consecutive layers do. At most
    :data:`MAX_ARROWS` arrows are drawn. Work is linear in tasks and edges."""
    folded = fold(keys, edges, open_groups)
    keys = folded.vertices
    n = len(keys)
    parents, children = _adjacency(keys, folded.edges)
    collapse = n > COLLAPSE_AT
    units = _units(n, parents, children, collapse)
    unit_parents, unit_children = _unit_edges(units, parents, children)
    unit_layer = _int_layers(len(units.members), unit_children, [len(ps) for ps in unit_parents])
    groups = _group(units, unit_layer, unit_parents, collapse)
    box_edges: set[tuple[int, int]] = set()
    for b in range(len(units.members)):
        gb = groups.group_of[b]
        for a in unit_parents[b]:
            if groups.group_of[a] != gb:
                box_edges.add((groups.group_of[a], gb))
    box_layer, columns = _columns(len(groups.members), box_edges)
    ids, kinds, members = _names(keys, units, groups, box_layer, folded.members)
    placed: list[tuple[str, str, tuple[str, ...], int, int]] = []
    for col_n, col in enumerate(columns):
        x = MARGIN + col_n * (BOX_W + GAP_X)
        for m, g in enumerate(col):
            placed.append((ids[g], kinds[g], members[g], x, MARGIN + m * (BOX_H + GAP_Y)))
    tallest = max((len(col) for col in columns), default=0)
    arrows = sorted((ids[a], ids[b]) for a, b in box_edges)
    box_of = {
        k: ids[groups.group_of[units.unit_of[v]]] for v in range(n) for k in folded.members.get(keys[v], [keys[v]])
    }
    return Skeleton(
        boxes=placed,
        arrows=arrows[:MAX_ARROWS],
        labels=arrow_labels(labels, box_of, set(arrows[:MAX_ARROWS])),
        width=MARGIN * 2 + max(len(columns), 1) * (BOX_W + GAP_X) - GAP_X,
        height=MARGIN * 2 + max(tallest, 1) * (BOX_H + GAP_Y) - GAP_Y,
        box_of=box_of,
        hidden_arrows=max(0, len(arrows) - MAX_ARROWS),
    )


def _adjacency(keys: Sequence[str], edges: Sequence[tuple[str, str]]) -> tuple[list[list[int]], list[list[int]]]:
    """Each key's parents and children by index in ``keys`` (edges between unknown keys dropped)."""
    index = {k: i for i, k in enumerate(keys)}
    parents: list[list[int]] = [[] for _ in keys]
    children: list[list[int]] = [[] for _ in keys]
    for p, c in edges:
        a, b = index.get(p), index.get(c)
        if a is not None and b is not None:
            parents[b].append(a)
            children[a].append(b)
    return parents, children


@dataclass
class _Units:
    """The tasks as units: a task, or a chain drawn as one box."""

    #: the tasks of each unit
    members: list[list[int]]
    #: whether each unit is a chain drawn as one
    chained: list[bool]
    #: the unit of each task
    unit_of: list[int]


def _units(n: int, parents: list[list[int]], children: list[list[int]], collapse: bool) -> _Units:
    """Each task its own unit, but (collapsing) a chain of :data:`CHAIN_MIN` or more one unit."""
    units = _Units([], [], [0] * n)
    for chain in _chains(n, parents, children) if collapse else [[v] for v in range(n)]:
        if len(chain) >= CHAIN_MIN:
            for v in chain:
                units.unit_of[v] = len(units.members)
            units.members.append(chain)
            units.chained.append(True)
        else:
            for v in chain:
                units.unit_of[v] = len(units.members)
                units.members.append([v])
                units.chained.append(False)
    return units


def _unit_edges(
    units: _Units, parents: list[list[int]], children: list[list[int]]
) -> tuple[list[list[int]], list[list[int]]]:
    """The units' parents and children (the tasks' own when every unit is one task)."""
    n, n_units = len(parents), len(units.members)
    if n_units == n:
        return parents, children
    unit_children: list[list[int]] = [[] for _ in range(n_units)]
    unit_parents: list[list[int]] = [[] for _ in range(n_units)]
    seen: set[tuple[int, int]] = set()
    for b in range(n):
        ub = units.unit_of[b]
        for a in parents[b]:
            ua = units.unit_of[a]
            if ua != ub and (ua, ub) not in seen:
                seen.add((ua, ub))
                unit_children[ua].append(ub)
                unit_parents[ub].append(ua)
    return unit_parents, unit_children


@dataclass
class _Groups:
    """The boxes as groups of units."""

    #: the units of each box
    members: list[list[int]]
    #: the box of each unit
    group_of: list[int]
    #: whether a box is a band of several layers
    banded: bool = False


def _group(units: _Units, unit_layer: list[int], unit_parents: list[list[int]], collapse: bool) -> _Groups:
    """The boxes: a unit each, but (collapsing) a wide layer one box per set of parent boxes
    (or one box), and past :data:`MAX_BOXES` one box per layer or band of layers."""
    n_units = len(units.members)
    by_layer: dict[int, list[int]] = {}
    for u in range(n_units):
        by_layer.setdefault(unit_layer[u], []).append(u)
    group_of: list[int] = [0] * n_units
    groups: list[list[int]] = []  # units per box
    for depth_n in sorted(by_layer):
        col = by_layer[depth_n]
        if not collapse or len(col) <= WIDE_LAYER:
            for u in col:
                group_of[u] = len(groups)
                groups.append([u])
            continue
        sigs: dict[int | frozenset[int], list[int]] = {}
        for u in col:
            ps = unit_parents[u]
            sig = group_of[ps[0]] if len(ps) == 1 else frozenset([group_of[p] for p in ps])
            sigs.setdefault(sig, []).append(u)
            if len(sigs) > GROUPS_PER_LAYER:
                break
        parts = list(sigs.values()) if len(sigs) <= GROUPS_PER_LAYER else [col]
        for part in parts:
            for u in part:
                group_of[u] = len(groups)
            groups.append(part)
    if collapse and len(groups) > MAX_BOXES:
        return _Groups(*_merge_layers(unit_layer, n_units, len(by_layer)))
    return _Groups(groups, group_of)


def _columns(n_boxes: int, box_edges: set[tuple[int, int]]) -> tuple[list[int], list[list[int]]]:
    """Each box's layer, and the boxes of each layer in their drawing order."""
    downs: list[list[int]] = [[] for _ in range(n_boxes)]
    indegree = [0] * n_boxes
    ups: dict[int, list[int]] = {}
    for a, b in box_edges:
        downs[a].append(b)
        indegree[b] += 1
        ups.setdefault(b, []).append(a)
    box_layer = _int_layers(n_boxes, downs, indegree)
    depth = max(box_layer, default=-1) + 1
    columns: list[list[int]] = [[] for _ in range(depth)]
    for g in range(n_boxes):
        columns[box_layer[g]].append(g)
    _order(columns, ups, dict(enumerate(downs)))
    return box_layer, columns


def _names(
    keys: Sequence[str], units: _Units, groups: _Groups, box_layer: list[int], folded: dict[str, tuple[str, ...]]
) -> tuple[list[str], list[str], list[tuple[str, ...]]]:
    """Each box's id, kind (``task``, ``group``: a folded task group, ``chain``, ``layer`` or
    ``band``) and keys (a folded group's vertex stands for its tasks)."""
    ids: list[str] = []
    kinds: list[str] = []
    members: list[tuple[str, ...]] = []
    for g, part in enumerate(groups.members):
        if len(part) == 1 and not units.chained[part[0]] and keys[units.members[part[0]][0]] in folded:
            vertex = keys[units.members[part[0]][0]]
            ids.append(group_box_id(vertex))
            kinds.append("group")
            members.append(folded[vertex])
            continue
        if len(part) == 1 and not units.chained[part[0]]:
            v = units.members[part[0]][0]
            ids.append(f"task-{v}-{_slug(keys[v])}")
            kinds.append("task")
            members.append((keys[v],))
            continue
        if len(part) == 1:
            v = units.members[part[0]][0]
            ids.append(f"chain-{v}-{_slug(keys[v])}")
            kinds.append("chain")
        else:
            kind = "band" if groups.banded else "layer"
            ids.append(f"{kind}-{box_layer[g]}-{g}")
            kinds.append(kind)
        members.append(tuple(k for u in part for v in units.members[u] for k in folded.get(keys[v], (keys[v],))))
    return ids, kinds, members


def _merge_layers(unit_layer: list[int], n_units: int, depth: int) -> tuple[list[list[int]], list[int], bool]:
    """Too many boxes: one box per layer, or per band of consecutive layers when the layers
    alone are more than :data:`MAX_BOXES`."""
    band = max(1, -(-depth // MAX_BOXES))
    by_band: dict[int, list[int]] = {}
    for u in range(n_units):
        by_band.setdefault(unit_layer[u] // band, []).append(u)
    merged: list[list[int]] = []
    group_of = [0] * n_units
    for n in sorted(by_band):
        for u in by_band[n]:
            group_of[u] = len(merged)
        merged.append(by_band[n])
    return merged, group_of, band > 1


def _slug(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", key)[:60]
