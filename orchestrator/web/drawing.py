"""A run's DAG drawn for the web app (:mod:`orchestrator.core.graph`; a big one in counted
groups): the drawing's rows read through the store's named reads, the skeletons of the last
runs drawn kept (a run's DAG never changes after submission), and a map's children drawn
when its box is expanded."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from ..core import graph as drawing

if TYPE_CHECKING:
    from ..engine.facade import Orchestrator

#: how many runs' drawing skeletons (:class:`orchestrator.graph.Skeleton`) a server keeps
SKELETONS = 4


class SkeletonCache:
    """The drawing skeletons of the last :data:`SKELETONS` runs drawn, by (run, task count, open
    task groups): a run's DAG never changes after submission, so a page load or a poll reads the
    tasks' states only (never the edges again). Every use is behind a read of the run that
    checks who may see it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._found: dict[tuple[Any, ...], drawing.Skeleton] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple[Any, ...]) -> drawing.Skeleton | None:
        with self._lock:
            found = self._found.pop(key, None)
            if found is not None:
                self._found[key] = found  # the newest last
            return found

    def knows(self, run_id: str) -> bool:
        """Whether a skeleton of ``run_id`` is kept (drawing it then costs one read of states)."""
        with self._lock:
            return any(k[0] == run_id for k in self._found)

    def put(self, key: tuple[Any, ...], skeleton: drawing.Skeleton) -> None:
        with self._lock:
            self._found[key] = skeleton
            while len(self._found) > self.size:
                self._found.pop(next(iter(self._found)))


SKELETON_CACHE = SkeletonCache(SKELETONS)


def drawing_rows(
    orc: Orchestrator, run_id: str
) -> tuple[list[tuple[Any, ...]], dict[str, dict[str, int]], dict[str, str]]:
    """What the drawing needs: ``(key, task name, state, trigger rule, attempt)`` of every task
    that is not a map's child, each mapped node's children counted per state (in the database:
    a map of 100,000 children is a few rows here), and the SKIPPED tasks' reasons. Raises
    :class:`RunNotFound` for a run this caller does not see."""
    reads = orc.reads
    rows = reads.drawing_tasks(run_id)
    maps: dict[str, dict[str, int]] = {r[0]: {} for r in rows if r[6]}
    for parent, counts in reads.map_child_counts(run_id).items():
        maps.setdefault(parent, {}).update(counts)
    skipped = {r[0]: r[5] for r in rows if r[5]}
    return [r[:5] for r in rows], maps, skipped


def run_drawing(
    orc: Orchestrator, run_id: str, open_groups: tuple[str, ...] | None = ()
) -> tuple[drawing.Skeleton, drawing.Graph]:
    """The run's DAG drawn (collapsed into counted groups when large, :func:`graph.structure`),
    from its tasks' states and its kept skeleton (the edges and their labels are read once per
    run and set of open groups). A map is one box counting its children (they have no edges,
    and the skeleton is made without them: a map growing does not change it). A task group
    not in ``open_groups`` is one box counting its tasks (``None``: every task drawn)."""
    found, maps, skipped = drawing_rows(orc, run_id)  # RunNotFound for a run this caller does not see
    kept = (run_id, len(found), open_groups)
    skeleton = SKELETON_CACHE.get(kept)
    if skeleton is None:
        skeleton = drawing.structure(
            [r[0] for r in found], orc.reads.edge_list(run_id), open_groups=open_groups,
            labels=orc.reads.edge_labels(run_id),
        )  # fmt: skip
        SKELETON_CACHE.put(kept, skeleton)
    return skeleton, drawing.paint_rows(skeleton, found, maps=maps, skipped=skipped)


#: the most children of one map its expanded view (``?part=map&key=K``) draws
MAP_CELLS = 1000

CELL, CELLS_PER_ROW = 14, 50


def map_children(orc: Orchestrator, run_id: str, key: str, limit: int = MAP_CELLS) -> tuple[list[Any], int]:
    """The first ``limit`` children of the map ``key`` in map order ``(key, state, attempt,
    skip reason, map index, map key)`` and how many it has. Raises :class:`RunNotFound`, or
    :class:`TaskNotFound` when ``key`` is not a mapped node of the run."""
    return orc.reads.map_children(run_id, key, limit=limit)


def map_svg(orc: Orchestrator, run_id: str, key: str) -> str:
    """A map's children drawn: one small square per child in map order, coloured by its state,
    each a link to its row of the task table (the first :data:`MAP_CELLS`; the task table lists
    them all)."""
    import html as markup

    children, total = map_children(orc, run_id, key)
    e = markup.escape
    rows = max(1, -(-len(children) // CELLS_PER_ROW))
    width, height = CELLS_PER_ROW * (CELL + 2) + 4, rows * (CELL + 2) + 24
    counts: dict[str, int] = {}
    cells = []
    for n, (k, state, attempt, skip, index, mkey) in enumerate(children):
        counts[state] = counts.get(state, 0) + 1
        x, y = 2 + (n % CELLS_PER_ROW) * (CELL + 2), 20 + (n // CELLS_PER_ROW) * (CELL + 2)
        why = f"; skipped: {skip}" if skip else ""
        link = f"?{urlencode({'q': k})}#task-{quote(k)}"
        cells.append(
            f'<g class="child" data-key="{e(k)}" data-state="{e(state)}" data-index="{index}">'
            f"<title>{e(k)}: {e(state)}{' #' + str(attempt) if attempt > 1 else ''}{e(why)} (item {index},"
            f' key {e(str(mkey))})</title><a href="{e(link)}"><rect x="{x}" y="{y}" width="{CELL}"'
            f' height="{CELL}" fill="{drawing.COLOURS.get(state, "#fff")}" stroke="#555"/></a></g>'
        )
    shown = f"{len(children):,} of {total:,} shown (the task table lists them all)" if total > len(children) else ""
    head_text = f"{key} \u00d7{total:,}: " + ", ".join(f"{n:,} {s.lower()}" for s, n in sorted(counts.items()))
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="map" data-map="{e(key)}" data-total="{total}"'
        f' width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" aria-label="map {e(key)}">'
        f'<text x="2" y="14" style="font:12px sans-serif">{e(head_text)} {e(shown)}</text>' + "".join(cells) + "</svg>"
    )


#: a run of more tasks whose skeleton is not kept is drawn after its page is served
DEFER_DRAWING_ABOVE = 2_000


def run_dag_svg(orc: Orchestrator, run_id: str, open_groups: tuple[str, ...] | None = ()) -> str:
    """The run page's drawing: the SVG, each task box a link to its row in the task table, each
    task group not in ``open_groups`` folded into one box (the page opens it on a click)."""
    _, picture = run_drawing(orc, run_id, open_groups)
    return drawing.to_svg(picture, href=lambda key: f"?{urlencode({'q': key})}#task-{quote(key)}")


def run_graph(orc: Orchestrator, run_id: str, open_groups: tuple[str, ...] | None = ()) -> drawing.Graph:
    """The run's picture (``/api/runs/RUN_ID/graph``, ``orchestrator runs graph``), each task
    group not in ``open_groups`` folded (``None``: none); raises :class:`RunNotFound` for a run
    this caller does not see."""
    return run_drawing(orc, run_id, open_groups)[1]
