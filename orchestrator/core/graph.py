"""A run's DAG drawn: a layered layout (pure code) rendered as SVG, Graphviz dot or Mermaid.

The run page of ``orchestrator serve`` and ``orchestrator graph RUN_ID`` draw the same picture
from the database: one box per task, coloured by its state, an arrow per dependency, and a
task's trigger rule written in its box (and its incoming arrows dashed) when it is not the
default ``all_success``. A SKIPPED task's box says why (``skipped: branch_not_taken``).

A mapped node is one box, whatever its width: its children (``resize[0]`` ...) are counted in
it (``resize \u00d710,000 · 9,990 ok · 10 failed``), never drawn one by one; they have no edges, so
the layout is decided without them (:func:`structure` takes the keys of the tasks that are not
map children) and :func:`paint_rows` takes their counts per state per map.

Layout: a task's layer is its longest path from a root, so every arrow points right; within a
layer, tasks are ordered by a few barycentre sweeps (the mean position of their neighbours),
which removes most crossings. A DAG with more than :data:`COLLAPSE_AT` tasks is drawn in counted
groups decided from its edges (:func:`structure`): a long chain is one box, a wide layer one box
per set of parents (``48,000 tasks: 47,990 SUCCEEDED, 10 FAILED``), and never more than
:data:`MAX_BOXES` boxes and :data:`MAX_ARROWS` arrows, so a 50,000-task run draws in a few
dozen kilobytes (the task table lists every task, paged); the SVG scales, so the page can zoom.
:func:`structure` needs only the keys and edges, and :func:`paint` adds the states, so a server
can keep a run's skeleton (a run's DAG never changes) and repaint it.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar

from .states import TaskState

#: fill colours by state (Airflow's palette where it has one)
COLOURS: dict[str, str] = {
    "PENDING": "#f0f0f0",
    "READY": "#d6e4f0",
    "QUEUED": "#b0c4de",
    "RUNNING": "#7fd67f",
    "RETRYING": "#f5d742",
    "SUCCEEDED": "#2e8b57",
    "FAILED": "#e0443e",
    "UPSTREAM_FAILED": "#f29d49",
    "SKIPPED": "#f4a6d7",
    "CANCELLED": "#a9a9a9",
    "DEAD_LETTER": "#8b1a1a",
    "MAPPED": "#8fd3c1",
    "WAITING": "#c7b8ea",
    "MIXED": "#ffffff",
}
#: states drawn with white text (dark fills)
DARK = frozenset({"SUCCEEDED", "FAILED", "DEAD_LETTER"})
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
DEFAULT_RULE = "all_success"
K = TypeVar("K", str, int)


@dataclass(frozen=True)
class Box:
    """One drawn box: a task (``keys`` has one key) or a collapsed layer (its keys)."""

    id: str
    label: str
    state: str
    keys: tuple[str, ...]
    task: str = ""
    trigger_rule: str = DEFAULT_RULE
    attempt: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    x: int = 0
    y: int = 0
    #: ``task``, ``map`` (a mapped node: ``counts`` are its children's), or what a collapsed box
    #: holds: a ``chain``, a (part of a) ``layer``, a ``band`` of layers
    kind: str = "task"
    #: why a SKIPPED task was skipped (``branch_not_taken``, ``short_circuit``, ...)
    skip_reason: str | None = None

    @property
    def collapsed(self) -> bool:
        return len(self.keys) != 1

    @property
    def mapped(self) -> bool:
        return self.kind == "map"


@dataclass(frozen=True)
class Graph:
    boxes: list[Box]
    arrows: list[tuple[str, str]]  # (box id, box id)
    width: int
    height: int
    #: arrows left out of the drawing (more than :data:`MAX_ARROWS`)
    hidden_arrows: int = 0

    def box(self, box_id: str) -> Box:
        return next(b for b in self.boxes if b.id == box_id)


@dataclass(frozen=True)
class TaskInfo:
    """What the layout needs of a task (a :class:`~orchestrator.core.models.TaskView` has it)."""

    key: str
    task: str
    state: str
    trigger_rule: str = DEFAULT_RULE
    attempt: int = 1
    skip_reason: str | None = None
    #: a map's child: its map's key (drawn in its map's box, not a box of its own)
    map_parent: str | None = None
    #: a mapped node (a map's header)
    is_map: bool = False


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

    #: (box id, kind, keys, x, y): kind ``task`` (one key), ``chain``, ``layer`` or ``band``
    boxes: list[tuple[str, str, tuple[str, ...], int, int]]
    arrows: list[tuple[str, str]]
    width: int
    height: int
    #: the box each key is drawn in
    box_of: dict[str, str]
    #: arrows left out (more than :data:`MAX_ARROWS`)
    hidden_arrows: int = 0


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


def structure(keys: Sequence[str], edges: Sequence[tuple[str, str]]) -> Skeleton:
    """Decide the boxes from the graph's structure, with bounded work and output.

    Up to :data:`COLLAPSE_AT` tasks, every task is a box. Above it: a chain of
    :data:`CHAIN_MIN` or more tasks (each link a parent's only child and that child's only
    parent) becomes one box; a layer wider than :data:`WIDE_LAYER` boxes becomes one box per
    set of parent boxes its members hang from (one box for the layer when those sets are more
    than :data:`GROUPS_PER_LAYER`); if that still leaves more than :data:`MAX_BOXES` boxes,
    every layer becomes one box, then bands of consecutive layers do. At most
    :data:`MAX_ARROWS` arrows are drawn. Work is linear in tasks and edges."""
    keys = sorted(set(keys))
    n = len(keys)
    index = {k: i for i, k in enumerate(keys)}
    parents: list[list[int]] = [[] for _ in range(n)]
    children: list[list[int]] = [[] for _ in range(n)]
    for p, c in edges:
        a, b = index.get(p), index.get(c)
        if a is not None and b is not None:
            parents[b].append(a)
            children[a].append(b)
    collapse = n > COLLAPSE_AT
    # units: a task, or a chain drawn as one
    units: list[list[int]] = []
    chained: list[bool] = []
    unit_of = [0] * n
    for chain in _chains(n, parents, children) if collapse else [[v] for v in range(n)]:
        if len(chain) >= CHAIN_MIN:
            for v in chain:
                unit_of[v] = len(units)
            units.append(chain)
            chained.append(True)
        else:
            for v in chain:
                unit_of[v] = len(units)
                units.append([v])
                chained.append(False)
    n_units = len(units)
    if n_units == n:
        unit_children, unit_parents = children, parents
    else:
        unit_children = [[] for _ in range(n_units)]
        unit_parents = [[] for _ in range(n_units)]
        seen: set[tuple[int, int]] = set()
        for b in range(n):
            ub = unit_of[b]
            for a in parents[b]:
                ua = unit_of[a]
                if ua != ub and (ua, ub) not in seen:
                    seen.add((ua, ub))
                    unit_children[ua].append(ub)
                    unit_parents[ub].append(ua)
    unit_layer = _int_layers(n_units, unit_children, [len(ps) for ps in unit_parents])
    # boxes: units, wide layers grouped by the boxes their members hang from
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
    banded = False
    if collapse and len(groups) > MAX_BOXES:
        groups, group_of, banded = _merge_layers(unit_layer, n_units, len(by_layer))
    # the drawn boxes and their arrows
    box_edges: set[tuple[int, int]] = set()
    for b in range(n_units):
        gb = group_of[b]
        for a in unit_parents[b]:
            if group_of[a] != gb:
                box_edges.add((group_of[a], gb))
    n_boxes = len(groups)
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
    ids: list[str] = []
    kinds: list[str] = []
    members: list[tuple[str, ...]] = []
    for g, part in enumerate(groups):
        if len(part) == 1 and not chained[part[0]]:
            v = units[part[0]][0]
            ids.append(f"task-{v}-{_slug(keys[v])}")
            kinds.append("task")
            members.append((keys[v],))
            continue
        if len(part) == 1:
            v = units[part[0]][0]
            ids.append(f"chain-{v}-{_slug(keys[v])}")
            kinds.append("chain")
        else:
            kind = "band" if banded else "layer"
            ids.append(f"{kind}-{box_layer[g]}-{g}")
            kinds.append(kind)
        members.append(tuple(keys[v] for u in part for v in units[u]))
    placed: list[tuple[str, str, tuple[str, ...], int, int]] = []
    for col_n, col in enumerate(columns):
        x = MARGIN + col_n * (BOX_W + GAP_X)
        for m, g in enumerate(col):
            placed.append((ids[g], kinds[g], members[g], x, MARGIN + m * (BOX_H + GAP_Y)))
    tallest = max((len(col) for col in columns), default=0)
    arrows = sorted((ids[a], ids[b]) for a, b in box_edges)
    box_of = {keys[v]: ids[group_of[unit_of[v]]] for v in range(n)}
    return Skeleton(
        boxes=placed,
        arrows=arrows[:MAX_ARROWS],
        width=MARGIN * 2 + max(depth, 1) * (BOX_W + GAP_X) - GAP_X,
        height=MARGIN * 2 + max(tallest, 1) * (BOX_H + GAP_Y) - GAP_Y,
        box_of=box_of,
        hidden_arrows=max(0, len(arrows) - MAX_ARROWS),
    )


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


def paint(skeleton: Skeleton, tasks: Iterable[TaskInfo]) -> Graph:
    """The skeleton's boxes with the tasks' states: a task's box its state, a group's box its
    counts per state (and the one state, or ``MIXED``), a map's box its children's counts."""
    rows: list[tuple[str, str, str, str | None, int | None]] = []
    maps: dict[str, dict[str, int]] = {}
    skipped: dict[str, str] = {}
    for t in tasks:
        if t.map_parent is not None:
            counts = maps.setdefault(t.map_parent, {})
            counts[t.state] = counts.get(t.state, 0) + 1
            continue
        rows.append((t.key, t.task, t.state, t.trigger_rule, t.attempt))
        if t.is_map:
            maps.setdefault(t.key, {})
        if t.skip_reason:
            skipped[t.key] = t.skip_reason
    return paint_rows(skeleton, rows, maps=maps, skipped=skipped)


def paint_rows(
    skeleton: Skeleton,
    rows: Iterable[tuple[str, str, str, str | None, int | None]],
    *,
    maps: Mapping[str, Mapping[str, int]] | None = None,
    skipped: Mapping[str, str] | None = None,
) -> Graph:
    """:func:`paint` from plain ``(key, task, state, trigger rule, attempt)`` rows (a big run's
    tasks straight from the database: no object per task; map children not among them), the
    mapped nodes' children counted per state (``maps``: header key -> state -> count; an empty
    count for a map not expanded yet) and the SKIPPED tasks' reasons (``skipped``)."""
    info = {r[0]: r for r in rows}
    maps = maps or {}
    skipped = skipped or {}
    boxes: list[Box] = []
    for box_id, kind, keys, x, y in skeleton.boxes:
        if kind == "task":
            k, task, state, rule, attempt = info.get(keys[0]) or (keys[0], "", "PENDING", None, None)
            children = maps.get(k)
            boxes.append(
                Box(
                    box_id, k, state, keys, task, rule or DEFAULT_RULE, attempt or 1,
                    counts=dict(sorted(children.items())) if children is not None else {},
                    x=x, y=y, kind="task" if children is None else "map", skip_reason=skipped.get(k),
                )
            )  # fmt: skip
            continue
        counts: dict[str, int] = {}
        for key in keys:
            found = info.get(key)
            st = found[2] if found is not None else "PENDING"
            counts[st] = counts.get(st, 0) + 1
        label = f"chain of {len(keys):,} tasks" if kind == "chain" else f"{len(keys):,} tasks"
        one = next(iter(counts)) if len(counts) == 1 else "MIXED"
        boxes.append(Box(box_id, label, one, keys, counts=dict(sorted(counts.items())), x=x, y=y, kind=kind))
    return Graph(
        boxes=boxes,
        arrows=skeleton.arrows,
        width=skeleton.width,
        height=skeleton.height,
        hidden_arrows=skeleton.hidden_arrows,
    )


def layout(tasks: Sequence[TaskInfo], edges: Sequence[tuple[str, str]]) -> Graph:
    """Place every task (or collapsed chain or layer) on a left-to-right layered grid; a map's
    children are counted in their map's box."""
    return paint(structure([t.key for t in tasks if t.map_parent is None], edges), tasks)


class _TaskLike(Protocol):
    @property
    def key(self) -> str: ...
    @property
    def task(self) -> str: ...
    @property
    def state(self) -> TaskState: ...
    @property
    def trigger_rule(self) -> str: ...
    @property
    def attempt(self) -> int: ...


def from_views(tasks: Iterable[_TaskLike], edges: Sequence[tuple[str, str]]) -> Graph:
    """Lay out :class:`~orchestrator.core.models.TaskView` rows (map children counted in their map's box)."""
    infos = [
        TaskInfo(
            t.key, t.task, _state(t.state), t.trigger_rule or DEFAULT_RULE, t.attempt or 1,
            skip_reason=getattr(t, "skip_reason", None), map_parent=getattr(t, "map_parent", None),
            is_map=getattr(t, "map_counts", None) is not None,
        )
        for t in tasks
    ]  # fmt: skip
    children = {i.map_parent for i in infos if i.map_parent is not None}
    infos = [replace(i, is_map=True) if i.key in children else i for i in infos]
    return layout(infos, edges)


def _state(value: object) -> str:
    return value.value if isinstance(value, TaskState) else str(value)


def _slug(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", key)[:60]


def _short(text: str, n: int = 22) -> str:
    return text if len(text) <= n else text[: n - 1] + "\u2026"


def to_svg(graph: Graph, *, href: Callable[[str], str] | None = None) -> str:
    """A standalone SVG document. Each task box is a ``<g class="node">`` with ``data-key``
    and ``data-state`` (the browser test and scripts read them) and a tooltip; ``href(key)``
    makes a task's box a link (the run page links to the task's row)."""
    e = html.escape
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="dag" width="{graph.width}" height="{graph.height}"'
        f' viewBox="0 0 {graph.width} {graph.height}" role="img" aria-label="DAG">',
        "<defs><marker id='arrow' viewBox='0 0 10 10' refX='10' refY='5' markerWidth='7' markerHeight='7'"
        " orient='auto-start-reverse'><path d='M0,0 L10,5 L0,10 z' fill='#555'/></marker></defs>",
        "<style>text{font:12px sans-serif}.sub{font-size:10px}.edge{fill:none;stroke:#777;stroke-width:1.3}"
        ".edge.rule{stroke-dasharray:5,3}</style>",
    ]
    where = {b.id: b for b in graph.boxes}
    for src, dst, dashed in _arrows(graph):
        a, b = where[src], where[dst]
        x1, y1, x2, y2 = a.x + BOX_W, a.y + BOX_H // 2, b.x, b.y + BOX_H // 2
        mid = (x1 + x2) // 2
        cls = "edge rule" if dashed else "edge"
        out.append(
            f'<path class="{cls}" data-from="{e(src)}" data-to="{e(dst)}" marker-end="url(#arrow)"'
            f' d="M{x1},{y1} C{mid},{y1} {mid},{y2} {x2},{y2}"/>'
        )
    for b in graph.boxes:
        fill = COLOURS.get(b.state, "#ffffff")
        ink = "#ffffff" if b.state in DARK else "#111111"
        bar = ""
        label = b.label
        if b.collapsed:
            title = counted(b)
            sub = ", ".join(f"{n:,} {s.lower()}" for s, n in _biggest(b.counts))
            attrs = (
                f'class="node collapsed" data-keys="{len(b.keys)}" data-state="{e(b.state)}"'
                f' data-kind="{e(b.kind)}" data-counts="{e(_counts_attr(b.counts))}"'
            )
            bar = _bar(b)
        elif b.mapped:
            key = b.keys[0]
            label, sub = map_label(b), map_sub(b)
            title = f"{counted(b)} ({b.task}): {b.state}{_why(b)}; trigger rule {b.trigger_rule}"
            attrs = (
                f'class="node map" data-key="{e(key)}" data-state="{e(b.state)}" data-rule="{e(b.trigger_rule)}"'
                f' data-kind="map" data-total="{sum(b.counts.values())}" data-counts="{e(_counts_attr(b.counts))}"'
                + (f' data-skip="{e(b.skip_reason)}"' if b.skip_reason else "")
            )
            bar = _bar(b) if b.counts else ""
        else:
            key = b.keys[0]
            rule = "" if b.trigger_rule == DEFAULT_RULE else f" \u00b7 {b.trigger_rule}"
            again = f" #{b.attempt}" if b.attempt > 1 else ""
            title = f"{key} ({b.task}): {b.state}{again}{_why(b)}; trigger rule {b.trigger_rule}"
            sub = f"skipped: {b.skip_reason}" if b.skip_reason else f"{b.state.lower()}{again}{rule}"
            attrs = f'class="node" data-key="{e(key)}" data-state="{e(b.state)}" data-rule="{e(b.trigger_rule)}"' + (
                f' data-skip="{e(b.skip_reason)}"' if b.skip_reason else ""
            )
        shape = (
            f'<rect x="{b.x}" y="{b.y}" width="{BOX_W}" height="{BOX_H}" rx="6" fill="{fill}" stroke="#333"/>'
            f'<text x="{b.x + 8}" y="{b.y + 18}" fill="{ink}">{e(_short(label))}</text>'
            f'<text class="sub" x="{b.x + 8}" y="{b.y + 34}" fill="{ink}">{e(_short(sub, 30))}</text>{bar}'
        )
        if href is not None and not b.collapsed:
            shape = f'<a href="{e(href(b.keys[0]))}">{shape}</a>'
        out.append(f'<g id="{e(b.id)}" {attrs}><title>{e(title)}</title>{shape}</g>')
    out.append("</svg>")
    return "\n".join(out)


def _why(b: Box) -> str:
    return f"; skipped: {b.skip_reason}" if b.skip_reason else ""


#: how a map's box names its children's states (``9,990 ok · 10 failed``)
WORDS = {"SUCCEEDED": "ok", "UPSTREAM_FAILED": "upstream failed", "DEAD_LETTER": "dead letter"}


def map_label(b: Box) -> str:
    """A map's box's first line: ``resize \u00d710,000`` (its children), ``resize (map)`` before it expands."""
    total = sum(b.counts.values())
    return f"{b.label} \u00d7{total:,}" if total else f"{b.label} (map)"


def map_sub(b: Box) -> str:
    """A map's box's second line: its children per state (``9,990 ok · 10 failed``), or its own
    state before it expands (or when it ended without children: ``skipped: empty_map``)."""
    if b.counts:
        return " \u00b7 ".join(f"{n:,} {WORDS.get(s, s.lower())}" for s, n in _biggest(b.counts))
    return f"skipped: {b.skip_reason}" if b.skip_reason else b.state.lower()


def counted(b: Box) -> str:
    """A collapsed box in words: ``48,000 tasks: 47,990 SUCCEEDED, 10 FAILED``; a map's box:
    ``resize \u00d710,000 · 9,990 ok · 10 failed``."""
    if b.mapped:
        return f"{map_label(b)} \u00b7 {map_sub(b)}"
    return f"{b.label}: " + ", ".join(f"{n:,} {s}" for s, n in _biggest(b.counts))


def _biggest(counts: dict[str, int]) -> list[tuple[str, int]]:
    return sorted(counts.items(), key=lambda sn: (-sn[1], sn[0]))


def _counts_attr(counts: dict[str, int]) -> str:
    return ",".join(f"{s}:{n}" for s, n in sorted(counts.items()))


def _bar(b: Box) -> str:
    """A strip along a collapsed box's foot, one segment per state (its share of the tasks)."""
    total = sum(b.counts.values()) or 1
    out, x = [], 0.0
    for s, n in sorted(b.counts.items()):
        w = (BOX_W - 12) * n / total
        out.append(
            f'<rect class="share" data-state="{s}" x="{b.x + 6 + x:.1f}" y="{b.y + BOX_H - 8}"'
            f' width="{w:.1f}" height="4" fill="{COLOURS.get(s, "#fff")}"/>'
        )
        x += w
    return "".join(out)


def _text(b: Box) -> list[str]:
    """A box's lines of text in dot and Mermaid: its label, then its state (and a trigger rule
    other than the default), or a collapsed layer's counts per state."""
    if b.collapsed:
        return [b.label, ", ".join(f"{n} {s.lower()}" for s, n in b.counts.items())]
    rule = [] if b.trigger_rule == DEFAULT_RULE else [b.trigger_rule]
    if b.mapped:
        return [map_label(b), map_sub(b), *rule]
    return [b.label, f"skipped: {b.skip_reason}" if b.skip_reason else b.state.lower(), *rule]


def _arrows(graph: Graph) -> list[tuple[str, str, bool]]:
    """(from, to, dashed): an arrow into a task with a trigger rule other than the default is dashed."""
    where = {b.id: b for b in graph.boxes}
    return [(a, b, where[b].trigger_rule != DEFAULT_RULE and not where[b].collapsed) for a, b in graph.arrows]


def to_dot(graph: Graph, name: str = "run") -> str:
    """Graphviz ``dot`` source (``dot -Tpng``)."""

    def q(text: str) -> str:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines = [
        f"digraph {q(name)} {{",
        "  rankdir=LR;",
        '  node [shape=box, style="rounded,filled", fontname="sans-serif"];',
    ]
    for b in graph.boxes:
        ink = "white" if b.state in DARK else "black"
        label = "\\n".join(_text(b)).replace('"', '\\"')
        lines.append(f'  {q(b.id)} [label="{label}", fillcolor="{COLOURS.get(b.state, "#ffffff")}", fontcolor={ink}];')
    for src, dst, dashed in _arrows(graph):
        lines.append(f"  {q(src)} -> {q(dst)}{' [style=dashed]' if dashed else ''};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_mermaid(graph: Graph) -> str:
    """A Mermaid ``flowchart LR`` (GitHub and most wikis render it)."""
    ids = {b.id: f"n{n}" for n, b in enumerate(graph.boxes)}
    lines = ["flowchart LR"]
    for b in graph.boxes:
        text = "<br/>".join(_text(b)).replace('"', "#quot;")
        lines.append(f'  {ids[b.id]}["{text}"]')
    for src, dst, dashed in _arrows(graph):
        lines.append(f"  {ids[src]} {'-.->' if dashed else '-->'} {ids[dst]}")
    for state, fill in COLOURS.items():
        ink = "#fff" if state in DARK else "#111"
        lines.append(f"  classDef {state.lower()} fill:{fill},color:{ink},stroke:#333")
    for b in graph.boxes:
        lines.append(f"  class {ids[b.id]} {b.state.lower()}")
    return "\n".join(lines) + "\n"


FORMATS: dict[str, Callable[[Graph], str]] = {"svg": to_svg, "dot": to_dot, "mermaid": to_mermaid}
