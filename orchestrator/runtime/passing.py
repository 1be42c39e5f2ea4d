"""A parent's result passed as Celery passes it (``core/dag/passing.py`` says how it is written):
the worker replaces a node's first-argument placeholder once its claim is accepted. A chain's
step gets its parent's result, a chord's body the list of its header's results; an error
callback (``link_error``) gets Celery's ``(request, exc, traceback)``, or the failed task's id
when it takes one argument, and is skipped when its part did not fail itself (a task before it
in the chain did: Celery never calls that part's callbacks)."""

from __future__ import annotations

import builtins
import inspect
import re
from collections.abc import Mapping
from typing import Any

from celery.app.task import Context

from ..core.dag.model import KWARGS, MAP_MARK
from ..core.dag.passing import ERROR, placeholder, resolve
from ..core.errors import Skip
from ..core.protocol import task_id
from ..core.registry import declares_upstream
from ..core.states import TaskState

#: a recorded error: ``Type: message`` and, after it, the fingerprint's evidence in brackets
_ERROR = re.compile(r"(?P<type>[A-Za-z_][\w.]*): ?(?P<message>.*?)(?: \[[^\[\]]*\])?", re.S)


def wants_upstream_kwarg(task: Any) -> bool:
    """Whether ``task``'s function declares ``upstream`` (decided once per task object)."""
    found = task.__dict__.get("_orc_declares_upstream")
    if found is None:
        found = task.__dict__["_orc_declares_upstream"] = declares_upstream(task)
    return bool(found)


def passed_args(orc: Any, task: Any, run_id: str, args: list[Any], upstream: dict[str, Any]) -> list[Any]:
    """``args`` as the body gets them: a result placeholder resolved from ``upstream``, an error
    placeholder turned into the error callback's arguments (read from the failed part's row)."""
    found = placeholder(args)
    if found is None:
        return args
    if found[0] != ERROR:
        return resolve(args, upstream)
    part = found[1]
    view = orc.reads.get_task(run_id, part)
    if view.state is not TaskState.FAILED:
        raise Skip(f"its part {part!r} did not fail itself ({view.state.value}): Celery calls no error callback")
    rest = list(args[1:])
    if args[0].get("pass", True) is False:
        return rest
    failed_id = task_id(run_id, part, view.attempt)
    if _takes_one(task):
        return [failed_id, *rest]
    request = Context(
        id=failed_id, task=view.task, args=view.args, kwargs=view.kwargs, hostname=view.worker, root_id=failed_id,
    )  # fmt: skip
    exc, trace = rebuilt_error(view.error or "")
    return [request, exc, trace, *rest]


def mapped_kwargs(app: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A map's child's keyword arguments as its body gets them, when its row says the worker
    finishes its item (``MAP_MARK``: ``{"kwarg", "transform"}``): the item passed through the
    transform's function (a registered task's ``run``, called in this attempt: its exceptions
    are the attempt's, a :class:`Skip` skips the child), and a ``kwargs_from`` item spread as
    keyword arguments."""
    kwargs = dict(kwargs)
    mark = kwargs.pop(MAP_MARK)
    kwarg, name = mark["kwarg"], mark.get("transform")
    item = kwargs.pop(kwarg, None)
    if name is not None:
        fn = app.tasks.get(name)
        if fn is None:
            raise LookupError(f"map transform {name!r} is not a task registered on this worker")
        item = fn.run(item)
    if kwarg != KWARGS:
        kwargs[kwarg] = item
        return kwargs
    if not isinstance(item, Mapping) or not all(isinstance(k, str) for k in item):
        raise TypeError(
            f"kwargs_from: the item{' after ' + repr(name) if name else ''} is {type(item).__name__}, not a mapping"
            " of keyword arguments"
        )
    return {**kwargs, **item}


def rebuilt_error(text: str) -> tuple[BaseException, str]:
    """The failed attempt's exception as the error callback gets it (a builtin exception of the
    recorded type, else an ``Exception`` subclass of that name) and the recorded text as its
    traceback (the worker that ran it kept no traceback object)."""
    found = _ERROR.fullmatch(text.strip())
    name, message = (found["type"], found["message"]) if found else ("Exception", text)
    short = name.rsplit(".", 1)[-1]
    kind = getattr(builtins, short, None)
    if not (isinstance(kind, type) and issubclass(kind, Exception)):
        kind = type(short, (Exception,), {"__module__": name.rsplit(".", 1)[0] if "." in name else "builtins"})
    try:
        exc = kind(message)
    except TypeError:  # a builtin that takes other arguments (UnicodeDecodeError...)
        exc = Exception(message)
    return exc, text


def _takes_one(task: Any) -> bool:
    """Celery's test of an old-style error callback: its function takes at most one positional
    argument (it then gets the failed task's id, not ``(request, exc, traceback)``)."""
    try:
        params = inspect.signature(task.run).parameters.values()
    except (TypeError, ValueError):
        return False
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) <= 1
