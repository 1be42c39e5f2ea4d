"""The bounds of a DAG: every pattern, number and size it may carry (the spec's schema; see the
README), and the checks of one value against them (free text, a deadline, resource names, plain
JSON). Each check names what is wrong, for an error message about bad input."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ValidationError
from ..states import TriggerRule

# every pattern is matched with fullmatch(): "a\n" is not "a"
#: a node's key: letters, digits, '_' and '-', after the names of the task groups it lies in, each
#: followed by '.' (``section_1.normal``), optionally ending in an index (``transform[0]``, the keys
#: a Celery group's parts get); at most 200 characters
KEY_RE = re.compile(r"(?=.{1,200}\Z)[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*(?:\[[0-9]{1,6}\])?", re.S)
TENANT_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
QUEUE_RE = re.compile(r"[A-Za-z0-9_.:-]{1,200}")
TASK_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]{0,254}")
#: pool names and rate limit keys
LIMIT_NAME_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
#: a resource's name as a node declares it: a breaker's name, where ``{tenant}`` may stand for
#: the run's tenant (expanded at submit)
RESOURCE_RE = re.compile(r"(?:[A-Za-z0-9_.:-]|\{tenant\})+")
#: the most resources one task may declare
MAX_RESOURCES = 16

#: the bounds of every number and size a DAG may carry (the spec's schema; see README)
MAX_ATTEMPTS = 1000
#: seconds: backoff base and cap
MAX_BACKOFF = 7 * 86400
#: seconds: the shortest time limit a node may ask for (a shorter one kills the body before it
#: can even claim); the longest is ORCHESTRATOR_MAX_TIME_LIMIT
MIN_TIME_LIMIT = 1.0
#: nesting of lists and objects in args, kwargs and params (a worker drops a message body
#: nested deeper than 64: see orchestrator.inbox)
MAX_JSON_DEPTH = 32
#: integers in args, kwargs and params: 64-bit signed
MAX_JSON_INT = 2**63 - 1
MAX_NAME_CHARS = 200
MAX_IDEMPOTENCY_KEY_CHARS = 200
MAX_LOGICAL_DATE_CHARS = 64
#: spec files larger than this are refused unread (bytes)
MAX_SPEC_BYTES = 16 * 1024 * 1024
#: slots one node may ask of its pool, and a pool's slots (``orchestrator pool set``)
MAX_POOL_SLOTS = 100_000
#: tasks of one run QUEUED or RUNNING at once (``max_active_tasks``)
MAX_ACTIVE_TASKS = 1_000_000
#: seconds: the longest deadline a DAG or a node may set (after the logical date, or the submit)
MAX_DEADLINE = 366 * 86400
#: Keyword under which a task that declares it receives its parents' results.
UPSTREAM_KWARG = "upstream"


@dataclass(frozen=True)
class SizeLimits:
    """Size limits applied by :meth:`DAG.validate`; the defaults accept a 100,000-node DAG.
    (Not the store's ``limits`` role: pools, rate limits and per-DAG limits.)"""

    max_nodes: int = 100_000
    max_node_bytes: int = 64 * 1024
    max_params_bytes: int = 256 * 1024


#: the former name of :class:`SizeLimits` (public API: ``orchestrator.Limits``), kept for callers
Limits = SizeLimits


#: the default and the hard cap of a map's children (``max_map_length``; the cap is
#: ``ORCHESTRATOR_MAX_NODES``'s default)
DEFAULT_MAX_MAP_LENGTH = 10_000
MAX_MAP_LENGTH = 100_000
#: how a map's several mapped arguments combine: item by item (to the shortest, as Python's and
#: Airflow's zip; to the longest with ``zip_fill``), item by item refusing unequal lengths, or
#: every pair
COMBINES = ("zip", "zip_strict", "product")
ON_EMPTY = ("skip", "success")
#: what a mapping's items are: its values (keys naming the children) or ``[key, value]`` pairs
MAP_ITEMS = ("values", "pairs")
#: the trigger rules a node mapped over a parent's result may not have: they can start it before
#: that parent is done, or only when it did not succeed, so there would be nothing to map over
MAP_REFUSED_RULES = frozenset(
    {
        TriggerRule.ALWAYS,
        TriggerRule.ONE_SUCCESS,
        TriggerRule.ONE_DONE,
        TriggerRule.ONE_FAILED,
        TriggerRule.ALL_FAILED,
        TriggerRule.ALL_SKIPPED,
    }
)
MAP_KEY_FIELD_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
#: a map wider than this inserts its children this many at a time (the next window once half of
#: the inserted ones are done): a 100,000-wide map starts its first child without inserting all.
#: Read when a submit writes a map's row (``MapSpec.to_row``), so a test narrows it by setting
#: ``orchestrator.core.dag.bounds.MAP_WINDOW``.
MAP_WINDOW = 10_000


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages about bad input."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - the type is evidence enough
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def label(value: Any) -> str:
    """A DAG name fit for an error message, whatever it is."""
    return value if isinstance(value, str) and not text_problem(value, MAX_NAME_CHARS) else short(value)


def text_problem(value: Any, max_chars: int) -> str | None:
    """Why ``value`` is not an acceptable free-text name (DAG name, idempotency key, logical
    date), or ``None``: a non-empty string of at most ``max_chars`` characters, no NUL, no
    control characters, no lone surrogates."""
    if not isinstance(value, str):
        return f"must be a string, not {type(value).__name__}"
    if not value:
        return "must not be empty"
    if len(value) > max_chars:
        return f"is {len(value)} characters, over {max_chars}"
    for ch in value:
        if ch < " " or ch == "\x7f":
            return f"holds the control character {ch!r}"
        if "\ud800" <= ch <= "\udfff":
            return "holds a lone surrogate (not valid Unicode)"
    return None


def positive(value: object) -> bool:
    """Whether ``value`` is a finite number above 0 (``True`` is no number here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def deadline_problem(value: Any) -> str | None:
    """Why ``value`` is not an acceptable ``deadline`` (seconds), or ``None`` (``None`` is no deadline)."""
    if value is None:
        return None
    if not positive(value) or value > MAX_DEADLINE:
        return f"deadline must be a number of seconds above 0 and at most {MAX_DEADLINE}, not {short(value)}"
    return None


def resources_problem(names: Any) -> str | None:
    """Why ``names`` is no list of resource names (``{tenant}`` allowed), or ``None``."""
    if not isinstance(names, (tuple, list)):
        return f"resources must be a list of resource names, not {short(names)}"
    if len(names) > MAX_RESOURCES:
        return f"a task may use at most {MAX_RESOURCES} resources, not {len(names)}"
    for name in names:
        if not isinstance(name, str) or len(name) > 64 or not RESOURCE_RE.fullmatch(name):
            return (
                f"resource {short(name)} must be 1-64 letters, digits, '_', '.', ':' or '-'"
                " (and {tenant} for the run's tenant)"
            )
    return None


def expand_resources(
    names: Sequence[str], tenant: str, *, dag: str | None = None, node: str | None = None
) -> list[str] | None:
    """A node's resources for a run of ``tenant`` (``{tenant}`` replaced), or ``None`` for none;
    raises :class:`ValidationError` when an expanded name is not a valid breaker name."""
    if not names:
        return None
    out = []
    for name in names:
        full = name.replace("{tenant}", tenant)
        if not LIMIT_NAME_RE.fullmatch(full):
            raise ValidationError(
                f"resource {name!r} for tenant {tenant!r} is {full!r}: a resource must be 1-64 letters,"
                " digits, '_', '.', ':' or '-'",
                dag=dag,
                node=node,
            )
        out.append(full)
    return list(dict.fromkeys(out))


def check_json(value: Any, what: str, *, dag: str | None = None, node: str | None = None) -> None:
    """Raise :class:`ValidationError` unless ``value`` is plain JSON.

    Plain JSON is None, bool, int, finite float, str, lists/tuples of it and dicts with
    string keys. NaN/Infinity, sets, bytes and other objects are refused.
    """
    stack: list[tuple[Any, str, int]] = [(value, what, 0)]
    while stack:
        item, where, depth = stack.pop()
        if item is None or isinstance(item, bool):
            continue
        if isinstance(item, int):
            if not -MAX_JSON_INT - 1 <= item <= MAX_JSON_INT:
                raise ValidationError(f"{where} holds an integer outside 64 bits", dag=dag, node=node)
            continue
        if isinstance(item, str):
            _check_string(item, where, dag, node)
            continue
        if isinstance(item, float):
            if not math.isfinite(item):
                raise ValidationError(f"{where} holds {item!r}, which is not JSON", dag=dag, node=node)
            continue
        if isinstance(item, (list, tuple, dict)) and depth >= MAX_JSON_DEPTH:
            raise ValidationError(f"{where} is nested more than {MAX_JSON_DEPTH} deep", dag=dag, node=node)
        if isinstance(item, (list, tuple)):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(item))
            continue
        if isinstance(item, dict):
            for k, v in item.items():
                if not isinstance(k, str):
                    raise ValidationError(f"{where} has the non-string key {short(k)}", dag=dag, node=node)
                _check_string(k, f"{where} key", dag, node)
                stack.append((v, f"{where}.{k}", depth + 1))
            continue
        raise ValidationError(f"{where} holds a {type(item).__name__}, which is not JSON", dag=dag, node=node)


def _check_string(value: str, where: str, dag: str | None, node: str | None) -> None:
    # Postgres stores neither NUL nor a lone surrogate in JSON text
    if "\x00" in value:
        raise ValidationError(f"{where} holds a NUL character", dag=dag, node=node)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError(f"{where} holds a lone surrogate (not valid Unicode)", dag=dag, node=node) from None


def json_size(value: Any) -> int:
    """The size of ``value`` as compact JSON text (characters)."""
    return len(json.dumps(value, separators=(",", ":")))
