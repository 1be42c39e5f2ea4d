"""How a parent's result reaches a child as Celery passes it: as the child's first positional
argument, not through the ``upstream`` parameter.

A node's first argument may be a placeholder, a one-key JSON object the worker replaces once
its claim is accepted (the claim carries the results of the parents that succeeded):

- ``{"__orc_result__": KEY}``: the result of the parent ``KEY`` (a chain's step, a node built
  with ``parent_arg=True``);
- ``{"__orc_results__": [KEY, ...]}``: the list of those parents' results, in that order (a
  chord's body, a step after a group);
- ``{"__orc_error__": KEY, "pass": true|false}``: an error callback (Celery's ``link_error``) of
  the part ``KEY``: it runs only when ``KEY`` itself FAILED (not when a task before it did), and
  gets Celery's ``(request, exc, traceback)`` (or the failed task's id, for a callback that takes
  one argument) before its own arguments, unless ``pass`` is false (an immutable ``.si()``).

The placeholders live in the node's arguments, so a run's snapshot, its spec, a registered DAG
and a rerun carry them unchanged. Validation refuses one that names no parent of its node."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

RESULT = "__orc_result__"
RESULTS = "__orc_results__"
ERROR = "__orc_error__"
MARKS = (RESULT, RESULTS, ERROR)


def result_arg(key: str) -> dict[str, Any]:
    """The placeholder of parent ``key``'s result."""
    return {RESULT: key}


def results_arg(keys: Sequence[str]) -> dict[str, Any]:
    """The placeholder of the list of ``keys``' results, in order."""
    return {RESULTS: list(keys)}


def error_arg(key: str, passes: bool = True) -> dict[str, Any]:
    """The placeholder of an error callback of ``key`` (``passes``: it gets the error's arguments)."""
    return {ERROR: key, "pass": passes}


def placeholder(args: Sequence[Any]) -> tuple[str, Any] | None:
    """``(mark, value)`` of ``args``' first argument when it is a placeholder, else ``None``."""
    if not args:
        return None
    first = args[0]
    if not isinstance(first, Mapping) or not first or len(first) > 2:
        return None
    for mark in MARKS:
        if mark in first:
            if mark != ERROR and len(first) != 1:
                return None
            return mark, first[mark]
    return None


def takes_results(args: Sequence[Any]) -> bool:
    """Whether a node with ``args`` needs its parents' results at its claim."""
    found = placeholder(args)
    return found is not None and found[0] in (RESULT, RESULTS)


def placeholder_problem(args: Sequence[Any], upstream: Sequence[str]) -> str | None:
    """What is wrong with ``args``' placeholder for a node whose parents are ``upstream``
    (``None``: nothing, or no placeholder). A placeholder anywhere but first is refused too."""
    for later in args[1:]:
        if isinstance(later, Mapping) and any(m in later for m in MARKS):
            return f"{', '.join(m for m in MARKS if m in later)} is reserved: only a node's first argument may be one"
    found = placeholder(args)
    if found is None:
        first = args[0] if args else None
        if isinstance(first, Mapping) and any(m in first for m in MARKS):
            return "a malformed result placeholder as first argument (see orchestrator.dag passing)"
        return None
    mark, value = found
    keys = list(value) if mark == RESULTS and isinstance(value, list) else [value]
    if mark == RESULTS and not isinstance(value, list):
        return f"{RESULTS} must list parent keys"
    if mark == ERROR and not isinstance(args[0].get("pass", True), bool):
        return f"{ERROR}'s 'pass' must be true or false"
    for key in keys:
        if not isinstance(key, str) or key not in upstream:
            return f"{mark} names {key!r}, which is not a parent of this node"
    return None


def resolve(args: Sequence[Any], upstream: Mapping[str, Any]) -> list[Any]:
    """``args`` with a result placeholder replaced by the parents' results (``upstream``: the
    claim's results of the parents that succeeded); an error placeholder is left to the worker."""
    found = placeholder(args)
    if found is None or found[0] == ERROR:
        return list(args)
    mark, value = found
    if mark == RESULT:
        return [upstream.get(value), *args[1:]]
    return [[upstream.get(k) for k in value], *args[1:]]
