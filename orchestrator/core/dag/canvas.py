"""Celery canvases as DAGs: :meth:`DAG.from_canvas` and ``orchestrator.submit(canvas)``.

A Celery signature is a ``dict`` underneath (``task``, ``args``, ``kwargs``, ``options``,
``subtask_type``, ``immutable``), so a canvas is read here without Celery. Each task signature
becomes a node; the DAG passes results exactly as Celery does (:mod:`.passing`):

- a chain passes each step's result to the next as its first positional argument, unless the
  next is immutable (``.si()``);
- a group's parts all get what came before; what comes after gets the list of their results, in
  order (a group of groups flattens, as Celery's does);
- a chord's body gets the list of its header's results in order;
- ``.set(queue=..., priority=..., soft_time_limit=..., time_limit=...)`` become the node's (on a
  chain, group or chord, its parts' where they set none); ``countdown``, ``eta``, ``expires`` and
  the other options :data:`.signatures.SIGNATURE_OPTIONS` refuses are refused here too;
- ``link_error`` (``on_error``) on a task adds its error callback as a node that runs only when
  that task fails (on a chain or group: on each part, as Celery links it; on a chord: its body);
  ``link`` on a task adds a callback node that gets the task's result.

Keys are stable and readable: a task's short name (``extract``), ``NAME[i]`` for the i-th part of
a group (``transform[0]``), ``NAME-KEY`` for a callback of ``KEY`` (``alert-extract``), and a
``-2``, ``-3`` suffix for a name used again."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ValidationError
from .passing import error_arg, result_arg, results_arg
from .signatures import SIGNATURE_OPTIONS

#: the options a chain, group or chord hands down to its parts (the parts' own win)
INHERITED = ("queue", "priority", "soft_time_limit", "time_limit")
#: attempts of a converted task: Celery with late acks (the project's app) runs a task again
#: when its worker is lost, and again when its body calls ``self.retry()``; an exception fails
#: it (Celery retries none without ``autoretry_for``). So a converted node retries only those:
#: a lost lease (the reconciler's retry, which ``retry_on`` does not filter) and ``self.retry()``
ATTEMPTS = 3
RETRY_ON = ("RetryRequested",)
_KINDS = ("chain", "group", "chord")


def is_canvas(value: Any) -> bool:
    """Whether ``value`` is a Celery signature (a task's, a chain's, a group's or a chord's)."""
    return isinstance(value, Mapping) and isinstance(value.get("task"), str) and "subtask_type" in value


def canvas_name(canvas: Mapping[str, Any]) -> str:
    """A default DAG name for ``canvas``: its kind and first task's short name (``chain-extract``)."""
    kind = canvas.get("subtask_type") or "task"
    first = canvas
    while first.get("subtask_type") in _KINDS:
        parts = _parts(first)
        if not parts:
            break
        first = parts[0]
    return f"{kind}-{_short(str(first.get('task')))}"[:200]


@dataclass(frozen=True)
class Flow:
    """What a canvas part hands on: the keys that must end first and what the next part gets as
    its first argument (``one``: a result; ``many``: the list of these results)."""

    keys: tuple[str, ...] = ()
    many: bool = False


def fill(dag: Any, canvas: Any, attempts: int = ATTEMPTS) -> None:
    """Add ``canvas``'s nodes to ``dag`` (a :class:`DAG`), each with ``attempts`` attempts
    (see :data:`ATTEMPTS`); raise :class:`ValidationError`."""
    if not is_canvas(canvas):
        raise ValidationError(f"a canvas must be a Celery signature, not {type(canvas).__name__}", dag=dag.name)
    _Builder(dag, attempts).add(canvas, Flow(), {})


class _Builder:
    def __init__(self, dag: Any, attempts: int) -> None:
        self.dag = dag
        self.retries = {"max_attempts": attempts, "retry_on": RETRY_ON}

    def add(self, sig: Mapping[str, Any], before: Flow, inherited: dict[str, Any], index: int | None = None) -> Flow:
        kind = sig.get("subtask_type")
        if kind is None:
            return self.task(sig, before, inherited, index)
        if kind not in _KINDS:
            raise self.error(f"a Celery {kind} is not supported in a canvas (chain, group and chord are)")
        options = dict(sig.get("options") or {})
        errbacks = _signatures(options.pop("link_error", None) or (), self)
        links = _signatures(options.pop("link", None) or (), self)
        down = {**inherited, **self.honoured(options, kind)}
        if kind == "chain":
            flow = before
            parts = _parts(sig)
            for i, part in enumerate(parts):
                extra = errbacks  # a chain's error callbacks go to every part
                flow = self.add(_with_errbacks(part, extra), flow, down)
                if i == len(parts) - 1 and links:
                    for link in links:
                        self.callback(link, flow)
            return flow
        if links:
            raise self.error(f"link on a {kind} is not supported: chain the callback after it")
        if kind == "group":
            return self.group([_with_errbacks(p, errbacks) for p in _parts(sig)], before, down)
        header, body = _chord_parts(sig, self)
        flow = self.group(header, before, down)
        return self.add(_with_errbacks(body, errbacks), flow, down)

    def group(self, parts: list[Mapping[str, Any]], before: Flow, inherited: dict[str, Any]) -> Flow:
        if not parts:
            raise self.error("an empty group has no task to run")
        keys: list[str] = []
        for i, part in enumerate(_flatten(parts)):
            flow = self.add(part, before, inherited, index=i)
            if flow.many:
                raise self.error("a group part that ends in a group (a nested list of results) is not supported")
            keys.extend(flow.keys)
        return Flow(tuple(keys), many=True)

    def task(self, sig: Mapping[str, Any], before: Flow, inherited: dict[str, Any], index: int | None) -> Flow:
        options = dict(sig.get("options") or {})
        errbacks = _signatures(options.pop("link_error", None) or (), self)
        links = _signatures(options.pop("link", None) or (), self)
        for option, value in inherited.items():
            options.setdefault(option, value)
        name = str(sig["task"])
        key = self.key(_short(name) if index is None else f"{_short(name)}[{index}]")
        args = list(sig.get("args") or ())
        if before.keys and not sig.get("immutable"):
            args.insert(0, results_arg(before.keys) if before.many else result_arg(before.keys[0]))
        part = {**sig, "args": args, "options": options, "subtask_type": None}
        self.dag.task(key, part, upstream=list(before.keys), **self.retries)
        for errback in errbacks:
            self.errback(errback, key)
        flow = Flow((key,))
        for link in links:
            self.callback(link, flow)
        return flow

    def errback(self, sig: Mapping[str, Any], part: str) -> None:
        """``sig`` runs when ``part`` fails (its placeholder skips it when ``part`` did not fail itself)."""
        if sig.get("subtask_type") is not None:
            raise self.error("an error callback must be a task signature, not a canvas")
        options = dict(sig.get("options") or {})
        key = self.key(f"{_short(str(sig['task']))}-{part.split('[', 1)[0]}{_index(part)}")
        args = [error_arg(part, passes=not sig.get("immutable")), *(sig.get("args") or ())]
        callback = {**sig, "args": args, "options": options}
        self.dag.task(key, callback, upstream=[part], trigger_rule="one_failed", **self.retries)

    def callback(self, sig: Mapping[str, Any], flow: Flow) -> None:
        """``sig`` (a ``link``) runs after ``flow`` succeeded, with its result as Celery passes it."""
        if sig.get("subtask_type") is not None:
            raise self.error("a link callback must be a task signature, not a canvas")
        self.task(sig, flow, {}, None)

    def honoured(self, options: Mapping[str, Any], kind: str) -> dict[str, Any]:
        """A chain's, group's or chord's options: the ones its parts inherit; any refused one raises."""
        found: dict[str, Any] = {}
        for option, value in options.items():
            what = SIGNATURE_OPTIONS.get(option)
            if option in INHERITED:
                found[option] = value
            elif what != "ignored" and option not in ("chord_size", "group_id", "group_index"):
                raise self.error(
                    f"option {option!r} on a {kind} is refused: {what or 'the orchestrator does not honour it'}"
                )
        return found

    def key(self, base: str) -> str:
        """``base``, or ``base-2``, ``base-3``... when taken (an index stays last: ``b-2[0]``)."""
        if base not in self.dag.nodes:
            return base
        stem, index = (base.split("[", 1)[0], _index(base))
        n = 2
        while f"{stem}-{n}{index}" in self.dag.nodes:
            n += 1
        return f"{stem}-{n}{index}"

    def error(self, message: str) -> ValidationError:
        return ValidationError(message, dag=self.dag.name)


def _short(name: str) -> str:
    """A task name's last dotted part, as a key may hold it."""
    tail = name.rsplit(".", 1)[-1]
    cleaned = "".join(c if c.isalnum() or c in "_-" else "_" for c in tail)
    return cleaned[:150] or "task"


def _index(key: str) -> str:
    return key[key.index("[") :] if "[" in key else ""


def _parts(sig: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    tasks = (sig.get("kwargs") or {}).get("tasks")
    if isinstance(tasks, Mapping):  # a group given as its one signature
        tasks = [tasks]
    return [t for t in (tasks or ())]


def _chord_parts(sig: Mapping[str, Any], b: _Builder) -> tuple[list[Mapping[str, Any]], Mapping[str, Any]]:
    kw = sig.get("kwargs") or {}
    header, body = kw.get("header"), kw.get("body")
    if kw.get("kwargs"):
        raise b.error("a chord's own kwargs are not supported: give them to its body")
    if isinstance(header, Mapping) and header.get("subtask_type") == "group":
        header = _parts(header)
    elif isinstance(header, Mapping):
        header = [header]
    if not isinstance(body, Mapping) or not is_canvas(body):
        raise b.error("a chord needs a body signature")
    return list(header or ()), body


def _flatten(parts: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """A group's parts with nested groups unrolled, as Celery's group does."""
    out: list[Mapping[str, Any]] = []
    for part in parts:
        if isinstance(part, Mapping) and part.get("subtask_type") == "group":
            out.extend(_flatten(_parts(part)))
        else:
            out.append(part)
    return out


def _signatures(value: Any, b: _Builder) -> list[Mapping[str, Any]]:
    items = [value] if isinstance(value, Mapping) else list(value)
    for item in items:
        if not is_canvas(item):
            raise b.error(f"a callback must be a Celery signature, not {type(item).__name__}")
    return items


def _with_errbacks(part: Mapping[str, Any], errbacks: list[Mapping[str, Any]]) -> Mapping[str, Any]:
    """``part`` with ``errbacks`` added to its ``link_error`` (a container's go to its parts)."""
    if not errbacks:
        return part
    options = dict(part.get("options") or {})
    mine = options.get("link_error") or []
    options["link_error"] = ([mine] if isinstance(mine, Mapping) else list(mine)) + list(errbacks)
    return {**part, "options": options}
