"""A run's DAG as boxes: a :class:`Skeleton` painted with its tasks' states (:func:`paint`),
a task's box its state, a counted group's box its counts per state, a mapped node's box its
children's counts. A map's children are never boxes of their own: they have no edges, so the
layout is decided without them and only their counts are painted."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from ..states import TaskState
from .fold import GROUP_BOX
from .skeleton import Skeleton, structure

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
    #: ``task``, ``map`` (a mapped node: ``counts`` are its children's), or what a collapsed box
    #: holds: a folded task ``group`` (``label`` its name), a ``chain``, a (part of a) ``layer``,
    #: a ``band`` of layers
    kind: str = "task"
    #: why a SKIPPED task was skipped (``branch_not_taken``, ``short_circuit``, ...)
    skip_reason: str | None = None

    @property
    def collapsed(self) -> bool:
        return len(self.keys) != 1 or self.kind == "group"

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
    #: the edges' labels on the arrows, by ``(box id, box id)`` (``DAG.label``)
    labels: dict[tuple[str, str], str] = field(default_factory=dict)

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
            if kind == "group" and maps.get(key):  # a folded group counts a map's children
                for st, n in maps[key].items():
                    counts[st] = counts.get(st, 0) + n
                continue
            found = info.get(key)
            st = found[2] if found is not None else "PENDING"
            counts[st] = counts.get(st, 0) + 1
        label = f"chain of {len(keys):,} tasks" if kind == "chain" else f"{len(keys):,} tasks"
        if kind == "group":
            label = box_id.removeprefix(GROUP_BOX)
        one = next(iter(counts)) if len(counts) == 1 else "MIXED"
        boxes.append(Box(box_id, label, one, keys, counts=dict(sorted(counts.items())), x=x, y=y, kind=kind))
    return Graph(
        boxes=boxes,
        arrows=skeleton.arrows,
        width=skeleton.width,
        height=skeleton.height,
        hidden_arrows=skeleton.hidden_arrows,
        labels=skeleton.labels,
    )


def layout(
    tasks: Sequence[TaskInfo],
    edges: Sequence[tuple[str, str]],
    *,
    open_groups: Collection[str] | None = None,
    labels: dict[tuple[str, str], str] | None = None,
) -> Graph:
    """Place every task (or collapsed chain or layer, or folded task group: ``open_groups``, as
    :func:`structure` takes it) on a left-to-right layered grid; a map's children are counted
    in their map's box; ``labels`` (by ``(parent key, child key)``) drawn on the arrows."""
    keys = [t.key for t in tasks if t.map_parent is None]
    return paint(structure(keys, edges, open_groups=open_groups, labels=labels), tasks)


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
