"""A run's tags (pure code): the labels ``submit(..., tags={"customer": "42"})`` stores on the run
(``orc_runs.tags``), checked before anything is written, and the ``KEY=VALUE`` filters that select
runs by them (``orchestrator runs --tag``, ``orchestrator bulk``, ``?tag=`` of the JSON API).

A tag is a key and a value, both strings: the key 1-64 of letters, digits, ``_ . : / -`` (it
starts with a letter, a digit or ``_``; never ``=``), the value 1-200 characters of text (no
control characters); at most :data:`MAX_TAGS` per run. A filter of several tags selects the runs
that hold every one of them (containment, ``tags @> filter``)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from .dag.bounds import text_problem
from .errors import TagError

#: the most tags one run may hold (and one filter may name)
MAX_TAGS = 16

#: a tag's key: 1-64 characters, no ``=`` (a filter is ``KEY=VALUE``) and no space
TAG_KEY_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:/-]{0,63}")

#: the longest value of a tag
MAX_TAG_VALUE_CHARS = 200


def _key_problem(key: Any) -> str | None:
    if not isinstance(key, str):
        return f"a tag's key must be a string, not {type(key).__name__}"
    if not TAG_KEY_RE.fullmatch(key):
        shown = key[:70] + ("..." if len(key) > 70 else "")
        return (
            f"tag key {shown!r} must be 1-64 letters, digits, '_', '.', ':', '/' or '-' (starting with a letter,"
            " a digit or '_')"
        )
    return None


def _value_problem(key: str, value: Any) -> str | None:
    if not isinstance(value, str):
        return f"tag {key!r}: the value must be a string, not {type(value).__name__} (tags are text: str(value))"
    problem = text_problem(value, MAX_TAG_VALUE_CHARS)
    return f"tag {key!r}: the value {problem}" if problem else None


def check_tags(tags: Any, *, what: str = "tags") -> dict[str, str]:
    """``tags`` as a run stores them (a plain ``dict`` of ``str`` to ``str``; ``None``: none), or
    :class:`~orchestrator.core.errors.TagError` naming the first tag that is wrong: not a mapping,
    more than :data:`MAX_TAGS`, a key or a value that is not a string or breaks its pattern."""
    if tags is None:
        return {}
    if not isinstance(tags, Mapping):
        raise TagError(
            f"{what} must be a mapping of str to str, such as {{'customer': '42'}}, not {type(tags).__name__}"
        )
    if len(tags) > MAX_TAGS:
        raise TagError(f"{what}: {len(tags)} tags, over the {MAX_TAGS} a run may hold")
    out: dict[str, str] = {}
    for key, value in tags.items():
        problem = _key_problem(key) or _value_problem(key, value)
        if problem:
            raise TagError(f"{what}: {problem}")
        out[key] = value
    return out


def parse_tag_filters(items: Iterable[str], *, option: str = "--tag") -> dict[str, str]:
    """``KEY=VALUE`` texts (``--tag customer=42 --tag region=eu``, ``?tag=customer=42``) as one
    filter: the runs that hold every one of them. The value is what follows the first ``=``.
    Raises :class:`~orchestrator.core.errors.TagError` for a text without ``=``, a key or value that
    a tag may not have, or one key given twice with two values (no run could match)."""
    out: dict[str, str] = {}
    for item in items:
        if not isinstance(item, str):
            raise TagError(f"{option} takes KEY=VALUE text, not {type(item).__name__}")
        key, sep, value = item.partition("=")
        if not sep:
            raise TagError(f"{option} takes KEY=VALUE, not {item[:70]!r}")
        problem = _key_problem(key) or _value_problem(key, value)
        if problem:
            raise TagError(f"{option} {item[:70]!r}: {problem}")
        if out.get(key, value) != value:
            raise TagError(
                f"{option}: tag {key!r} given twice ({out[key][:40]!r} and {value[:40]!r}); a run holds one value per"
                " key, so no run could match both"
            )
        out[key] = value
    if len(out) > MAX_TAGS:
        raise TagError(f"{option}: {len(out)} tags, over the {MAX_TAGS} a run may hold")
    return out


def tags_text(tags: Mapping[str, str]) -> str:
    """Tags as one line of ``KEY=VALUE`` pairs in key order (``customer=42 region=eu``): what
    ``orchestrator runs`` and ``status`` print, and what ``--tag`` reads back."""
    return " ".join(f"{k}={v}" for k, v in sorted(tags.items()))
