"""A run's DAG drawn: a layered layout (pure code) rendered as SVG, Graphviz dot or Mermaid.

The run page of ``orchestrator serve`` and ``orchestrator graph RUN_ID`` draw the same picture
from the database: one box per task, coloured by its state, an arrow per dependency, and a
task's trigger rule written in its box (and its incoming arrows dashed) when it is not the
default ``all_success``.

Layout: a task's layer is its longest path from a root, so every arrow points right; within a
layer, tasks are ordered by a few barycentre sweeps (the mean position of their neighbours),
which removes most crossings. A DAG with more than :data:`COLLAPSE_AT` tasks keeps every layer
of up to :data:`WIDE_LAYER` tasks and draws a wider layer as one box that counts its tasks per
state (the task table lists them all); the SVG scales, so the page can zoom.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

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
    "MIXED": "#ffffff",
}
#: states drawn with white text (dark fills)
DARK = frozenset({"SUCCEEDED", "FAILED", "DEAD_LETTER"})
#: above this many tasks, layers wider than WIDE_LAYER are drawn as one summary box
COLLAPSE_AT = 300
WIDE_LAYER = 40
BOX_W, BOX_H, GAP_X, GAP_Y, MARGIN = 170, 46, 60, 14, 16
DEFAULT_RULE = "all_success"


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

    @property
    def collapsed(self) -> bool:
        return len(self.keys) != 1


@dataclass(frozen=True)
class Graph:
    boxes: list[Box]
    arrows: list[tuple[str, str]]  # (box id, box id)
    width: int
    height: int

    def box(self, box_id: str) -> Box:
        return next(b for b in self.boxes if b.id == box_id)


@dataclass(frozen=True)
class TaskInfo:
    """What the layout needs of a task (a :class:`~orchestrator.models.TaskView` has it)."""

    key: str
    task: str
    state: str
    trigger_rule: str = DEFAULT_RULE
    attempt: int = 1


def layers(keys: Sequence[str], edges: Iterable[tuple[str, str]]) -> dict[str, int]:
    """Each key's layer: the length of its longest path from a root (Kahn's order)."""
    children: dict[str, list[str]] = {k: [] for k in keys}
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


def _order(by_layer: list[list[str]], parents: dict[str, list[str]], children: dict[str, list[str]]) -> None:
    """Barycentre sweeps, down then up, in place: fewer crossings, stable for ties."""
    for sweep in range(4):
        down = sweep % 2 == 0
        rng = range(1, len(by_layer)) if down else range(len(by_layer) - 2, -1, -1)
        for i in rng:
            ref = by_layer[i - 1] if down else by_layer[i + 1]
            pos = {k: n for n, k in enumerate(ref)}
            near = parents if down else children

            def centre(key: str, pos: dict[str, int] = pos, near: dict[str, list[str]] = near) -> float:
                seen = [pos[n] for n in near.get(key, ()) if n in pos]
                return sum(seen) / len(seen) if seen else float("inf")

            current = {k: n for n, k in enumerate(by_layer[i])}
            by_layer[i].sort(key=lambda k: (centre(k), current[k]))


def layout(tasks: Sequence[TaskInfo], edges: Sequence[tuple[str, str]]) -> Graph:
    """Place every task (or collapsed layer) on a left-to-right layered grid."""
    info = {t.key: t for t in tasks}
    keys = sorted(info)
    index = {k: n for n, k in enumerate(keys)}
    layer_of = layers(keys, edges)
    depth = max(layer_of.values(), default=-1) + 1
    by_layer: list[list[str]] = [[] for _ in range(depth)]
    for key in keys:
        by_layer[layer_of[key]].append(key)
    parents: dict[str, list[str]] = {}
    children: dict[str, list[str]] = {}
    for p, c in edges:
        if p in info and c in info:
            parents.setdefault(c, []).append(p)
            children.setdefault(p, []).append(c)
    _order(by_layer, parents, children)

    collapse = len(keys) > COLLAPSE_AT
    box_of: dict[str, str] = {}
    boxes: list[Box] = []
    tallest = max((len(col) if not (collapse and len(col) > WIDE_LAYER) else 1 for col in by_layer), default=0)
    for n, col in enumerate(by_layer):
        x = MARGIN + n * (BOX_W + GAP_X)
        if collapse and len(col) > WIDE_LAYER:
            counts: dict[str, int] = {}
            for key in col:
                counts[info[key].state] = counts.get(info[key].state, 0) + 1
            states = set(counts)
            box_id = f"layer-{n}"
            for key in col:
                box_of[key] = box_id
            boxes.append(
                Box(
                    id=box_id,
                    label=f"{len(col)} tasks",
                    state=states.pop() if len(states) == 1 else "MIXED",
                    keys=tuple(col),
                    counts=dict(sorted(counts.items())),
                    x=x,
                    y=MARGIN,
                )
            )
            continue
        for m, key in enumerate(col):
            t = info[key]
            box_id = f"task-{index[key]}-{_slug(key)}"
            box_of[key] = box_id
            boxes.append(
                Box(
                    id=box_id,
                    label=key,
                    state=t.state,
                    keys=(key,),
                    task=t.task,
                    trigger_rule=t.trigger_rule,
                    attempt=t.attempt,
                    x=x,
                    y=MARGIN + m * (BOX_H + GAP_Y),
                )
            )
    linked = {(box_of[p], box_of[c]) for p, c in edges if p in box_of and c in box_of}
    arrows = sorted((a, b) for a, b in linked if a != b)
    width = MARGIN * 2 + max(depth, 1) * (BOX_W + GAP_X) - GAP_X
    height = MARGIN * 2 + max(tallest, 1) * (BOX_H + GAP_Y) - GAP_Y
    return Graph(boxes=boxes, arrows=arrows, width=width, height=height)


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
    """Lay out :class:`~orchestrator.models.TaskView` rows."""
    infos = [TaskInfo(t.key, t.task, _state(t.state), t.trigger_rule or DEFAULT_RULE, t.attempt or 1) for t in tasks]
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
        if b.collapsed:
            title = f"{b.label}: " + ", ".join(f"{n} {s}" for s, n in b.counts.items())
            sub = ", ".join(f"{n} {s.lower()}" for s, n in b.counts.items())
            attrs = f'class="node collapsed" data-keys="{len(b.keys)}" data-state="{e(b.state)}"'
        else:
            key = b.keys[0]
            rule = "" if b.trigger_rule == DEFAULT_RULE else f" \u00b7 {b.trigger_rule}"
            again = f" #{b.attempt}" if b.attempt > 1 else ""
            title = f"{key} ({b.task}): {b.state}{again}; trigger rule {b.trigger_rule}"
            sub = f"{b.state.lower()}{again}{rule}"
            attrs = f'class="node" data-key="{e(key)}" data-state="{e(b.state)}" data-rule="{e(b.trigger_rule)}"'
        shape = (
            f'<rect x="{b.x}" y="{b.y}" width="{BOX_W}" height="{BOX_H}" rx="6" fill="{fill}" stroke="#333"/>'
            f'<text x="{b.x + 8}" y="{b.y + 18}" fill="{ink}">{e(_short(b.label))}</text>'
            f'<text class="sub" x="{b.x + 8}" y="{b.y + 34}" fill="{ink}">{e(_short(sub, 30))}</text>'
        )
        if href is not None and not b.collapsed:
            shape = f'<a href="{e(href(b.keys[0]))}">{shape}</a>'
        out.append(f'<g id="{e(b.id)}" {attrs}><title>{e(title)}</title>{shape}</g>')
    out.append("</svg>")
    return "\n".join(out)


def _text(b: Box) -> list[str]:
    """A box's lines of text in dot and Mermaid: its label, then its state (and a trigger rule
    other than the default), or a collapsed layer's counts per state."""
    if b.collapsed:
        return [b.label, ", ".join(f"{n} {s.lower()}" for s, n in b.counts.items())]
    return [b.label, b.state.lower()] + ([] if b.trigger_rule == DEFAULT_RULE else [b.trigger_rule])


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
