"""A request's query and form parameters, checked (a bad one is a
:class:`~orchestrator.core.errors.ValidationError`, answered 400), and the bounds of the pages:
rows per page, the deepest offset, the most rows one page may ask for."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..core.dag import KEY_RE
from ..core.errors import ValidationError
from ..core.states import RunState, TaskState
from ..core.tags import parse_tag_filters
from .base import BaseHandler

PAGE_SIZE = 50

#: the deepest page (an offset walks the index that far): filter by DAG, state or tenant instead
MAX_OFFSET = 100_000

#: ledger rows per page of the run page (older pages: ``?events_before=ID``)
LEDGER_ROWS = 100

#: task rows per page of the run page's table (``?limit=``, at most MAX_LIMIT)
TASK_ROWS = 100

#: tasks, edges and ledger rows per page of ``/api/runs/RUN_ID`` unless ``limit`` / ``events`` say otherwise
API_LIMIT = 500

#: the most tasks or edges one page may ask for
MAX_LIMIT = 1000

#: the most ledger rows one page (``events=N``) may ask for
MAX_EVENTS = 5000

#: the most ledger rows ``/api/runs/RUN_ID/changes`` answers at once (``more`` says when more wait)
CHANGES_LIMIT = 500


def run_filters(handler: BaseHandler) -> dict[str, Any]:
    """The runs list's filters from the query: ``tenant``, ``dag``, ``state`` and ``tag=KEY=VALUE``
    (repeatable: runs holding every one; as ``tags``, a dict)."""
    state = handler.get_query_argument("state", "") or None
    if state is not None:
        try:
            RunState(state.upper())
        except ValueError:
            raise ValidationError(f"unknown run state {state!r}; one of {', '.join(RunState)}") from None
    return {
        "tenant": handler.get_query_argument("tenant", "") or None,
        "dag": handler.get_query_argument("dag", "") or None,
        "state": state,
        "tags": tag_filters(handler.get_query_arguments("tag")),
    }


def tag_filters(values: list[str]) -> dict[str, str]:
    """``tag=KEY=VALUE`` parameters (query or form; empty ones, a form's blank field, left out) as
    one tag filter; a bad one is a :class:`~orchestrator.core.errors.TagError` (400)."""
    return parse_tag_filters([v for v in (x.strip() for x in values) if v], option="tag")


def filter_query(filters: dict[str, Any]) -> list[tuple[str, str]]:
    """The runs list's filters as query parameters again (``tag`` once per tag), for its links."""
    pairs = [(k, str(v)) for k, v in filters.items() if v and k != "tags"]
    return pairs + [("tag", f"{k}={v}") for k, v in sorted((filters.get("tags") or {}).items())]


def int_arg(handler: BaseHandler, name: str, default: int, low: int, high: int) -> int:
    raw = handler.get_query_argument(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        raise ValidationError(f"{name} must be a whole number, not {raw!r}") from None
    if not low <= value <= high:
        raise ValidationError(f"{name} must be between {low} and {high}")
    return value


@dataclass(frozen=True)
class TaskQuery:
    """A page of a run's tasks as asked: keyset cursors on the key, a state, a key search."""

    limit: int
    after: str | None = None
    before: str | None = None
    state: str | None = None
    search: str | None = None

    def params(self, default_limit: int) -> dict[str, str]:
        """The filters as query parameters (not the cursors)."""
        out = {"state": self.state or "", "q": self.search or ""}
        if self.limit != default_limit:
            out["limit"] = str(self.limit)
        return {k: v for k, v in out.items() if v}


#: a task's key: a node's (``KEY_RE``: a task group's prefix included), or a map child's
#: ``node[map key]`` (the map keys the server accepts, ``orc_expand_v1``)
TASK_KEY_RE = re.compile(r"[A-Za-z0-9_.-]{1,200}(?:\[[A-Za-z0-9_.,:=-]{1,100}\])?")
#: what joins the two keys of an edge cursor (``edges_after``): never in a key (a key may hold '.')
EDGE_SEPARATOR = "~"


def task_query(handler: BaseHandler, default_limit: int) -> TaskQuery:
    def key_arg(name: str) -> str | None:
        value = handler.get_query_argument(name, "") or None
        if value is not None and not TASK_KEY_RE.fullmatch(value):
            raise ValidationError(
                f"{name} must be a task key (letters, digits, '_', '-', a group's '.'; a map's child: node[key])"
            )
        return value

    state = handler.get_query_argument("state", "").strip().upper() or None
    if state is not None and state not in TaskState.__members__:
        raise ValidationError(f"unknown task state {state!r}; one of {', '.join(TaskState)}")
    search = handler.get_query_argument("q", "").strip() or None
    if search is not None and len(search) > 200:
        raise ValidationError("q (a key search) is at most 200 characters")
    return TaskQuery(
        limit=int_arg(handler, "limit", default_limit, 1, MAX_LIMIT),
        after=key_arg("after"),
        before=key_arg("before"),
        state=state,
        search=search,
    )


def opt_int(handler: BaseHandler, name: str) -> int | None:
    raw = handler.get_query_argument(name, "")
    return None if raw == "" else int_arg(handler, name, 0, 0, 2**62)


def edge_cursor(handler: BaseHandler) -> tuple[str, str] | None:
    raw = handler.get_query_argument("edges_after", "")
    if not raw:
        return None
    parent, _, child = raw.partition(EDGE_SEPARATOR)
    if not (KEY_RE.fullmatch(parent) and KEY_RE.fullmatch(child)):
        raise ValidationError(f"edges_after must be PARENT{EDGE_SEPARATOR}CHILD (two task keys)")
    return parent, child


#: a task group's full name (``section_2.inner``), as ``expand=`` names it
GROUP_RE = re.compile(r"(?=.{1,200}\Z)[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*", re.S)
#: the most groups one ``expand=`` opens by name
MAX_OPEN_GROUPS = 100


def open_groups(handler: BaseHandler) -> tuple[str, ...] | None:
    """The drawing's ``expand``: the task groups drawn task by task, comma-separated (absent or
    empty: every group folded into one box), or ``*`` (none folded: ``None``)."""
    raw = handler.get_query_argument("expand", "").strip()
    if raw == "*":
        return None
    names = tuple(sorted({n for n in raw.split(",") if n}))
    if len(names) > MAX_OPEN_GROUPS or not all(GROUP_RE.fullmatch(n) for n in names):
        raise ValidationError(
            f"expand must be '*' or at most {MAX_OPEN_GROUPS} task group names (section_1,section_2.inner)"
        )
    return names


def flag(handler: BaseHandler, name: str) -> bool:
    """A yes/no form field or query parameter (a checkbox sends ``on`` or its value; absent: no)."""
    raw = handler.get_argument(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValidationError(f"{name} must be 1 or 0 (true or false), not {raw[:40]!r}")
