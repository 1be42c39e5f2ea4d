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

from .boxes import DEFAULT_RULE, Box, Graph, TaskInfo, from_views, layout, paint, paint_rows
from .render import COLOURS, DARK, FORMATS, WORDS, counted, map_label, map_sub, to_dot, to_mermaid, to_svg
from .skeleton import (
    BOX_H,
    BOX_W,
    CHAIN_MIN,
    COLLAPSE_AT,
    GAP_X,
    GAP_Y,
    GROUPS_PER_LAYER,
    MARGIN,
    MAX_ARROWS,
    MAX_BOXES,
    WIDE_LAYER,
    Skeleton,
    layers,
    structure,
)

__all__ = [
    "BOX_H", "BOX_W", "CHAIN_MIN", "COLLAPSE_AT", "COLOURS", "DARK", "DEFAULT_RULE", "FORMATS", "GAP_X", "GAP_Y",
    "GROUPS_PER_LAYER", "MARGIN", "MAX_ARROWS", "MAX_BOXES", "WIDE_LAYER", "WORDS", "Box", "Graph", "Skeleton",
    "TaskInfo", "counted", "from_views", "layers", "layout", "map_label", "map_sub", "paint", "paint_rows",
    "structure", "to_dot", "to_mermaid", "to_svg",
]  # fmt: skip
