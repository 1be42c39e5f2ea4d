"""A painted :class:`Graph` rendered: a standalone SVG (the run page), Graphviz dot and Mermaid
(``orchestrator graph RUN_ID --format``). One box per task or counted group, filled by state; a
trigger rule other than ``all_success`` written in its box and its incoming arrows dashed; an
edge's label (``DAG.label``) on its arrow; a folded task group a box ``▸ section_1`` counting its
tasks (``data-group``: the run page opens it on a click)."""

from __future__ import annotations

import html
from collections.abc import Callable

from .boxes import DEFAULT_RULE, Box, Graph
from .skeleton import BOX_H, BOX_W

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
        ".edge.rule{stroke-dasharray:5,3}.elabel{font-size:10px;paint-order:stroke;stroke:#fff;stroke-width:3px}"
        ".group{cursor:pointer}</style>",
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
        if (src, dst) in graph.labels:  # an edge label (DAG.label) at the arrow's middle
            text = graph.labels[(src, dst)]
            out.append(
                f'<text class="elabel" data-from="{e(src)}" data-to="{e(dst)}" x="{mid}" y="{(y1 + y2) // 2 - 4}"'
                f' text-anchor="middle" fill="#333">{e(_short(text, 28))}<title>{e(text)}</title></text>'
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
                f'class="node collapsed{" group" if b.kind == "group" else ""}" data-keys="{len(b.keys)}"'
                f' data-state="{e(b.state)}" data-kind="{e(b.kind)}" data-counts="{e(_counts_attr(b.counts))}"'
                + (f' data-group="{e(b.label)}"' if b.kind == "group" else "")
            )
            if b.kind == "group":
                label = f"\u25b8 {b.label}"  # a folded group: the run page opens it on a click
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
    head = f"group {b.label}, {len(b.keys):,} tasks" if b.kind == "group" else b.label
    return f"{head}: " + ", ".join(f"{n:,} {s}" for s, n in _biggest(b.counts))


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
        head = f"group {b.label} ({len(b.keys)} tasks)" if b.kind == "group" else b.label
        return [head, ", ".join(f"{n} {s.lower()}" for s, n in b.counts.items())]
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
        style = ["style=dashed"] if dashed else []
        if (src, dst) in graph.labels:
            style.append(f"label={q(graph.labels[(src, dst)])}")
        lines.append(f"  {q(src)} -> {q(dst)}{' [' + ', '.join(style) + ']' if style else ''};")
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
        said = graph.labels.get((src, dst))
        if said is None:
            lines.append(f"  {ids[src]} {'-.->' if dashed else '-->'} {ids[dst]}")
        else:  # an edge label: A -- "text" --> B
            said = '"' + said.replace('"', "#quot;") + '"'
            lines.append(f"  {ids[src]} {'-. ' + said + ' .->' if dashed else '-- ' + said + ' -->'} {ids[dst]}")
    for state, fill in COLOURS.items():
        ink = "#fff" if state in DARK else "#111"
        lines.append(f"  classDef {state.lower()} fill:{fill},color:{ink},stroke:#333")
    for b in graph.boxes:
        lines.append(f"  class {ids[b.id]} {b.state.lower()}")
    return "\n".join(lines) + "\n"


FORMATS: dict[str, Callable[[Graph], str]] = {"svg": to_svg, "dot": to_dot, "mermaid": to_mermaid}
