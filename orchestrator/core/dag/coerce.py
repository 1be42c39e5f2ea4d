"""What the builder (:meth:`DAG.task`) accepts turned into a node's fields: a name into its enum
member, a backoff mapping into a :class:`Backoff`, exception classes into their names, resource
names deduplicated, a map's ``over`` into its mapped arguments, a transform into its task name.
Each raises :class:`ValidationError` naming the DAG and the node."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..backoff import Backoff, Jitter
from ..errors import ValidationError
from .bounds import resources_problem, short
from .model import MapArg, Node


def enum_value(cls: Any, value: Any, what: str, dag: str | None = None, node: str | None = None) -> Any:
    """``cls(value)``; raises :class:`ValidationError` listing the choices for an unknown value."""
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(m.value for m in cls)
        raise ValidationError(f"unknown {what} {value!r} (one of: {choices})", dag=dag, node=node) from None


def backoff_value(value: Backoff | Mapping[str, Any] | None, dag: str, key: str) -> Backoff:
    """A node's backoff: a :class:`Backoff` as it is, a mapping ``{base, cap, jitter}``, or the default."""
    if value is None:
        return Backoff()
    if isinstance(value, Backoff):
        return value
    if not isinstance(value, Mapping):
        raise ValidationError("backoff must be a mapping {base, cap, jitter}", dag=dag, node=key)
    unknown = set(value) - {"base", "cap", "jitter"}
    if unknown:
        raise ValidationError(f"unknown backoff field(s) {sorted(unknown)}", dag=dag, node=key)
    return Backoff(
        base=value.get("base", 1.0),
        cap=value.get("cap", 60.0),
        jitter=enum_value(Jitter, value.get("jitter", "full"), "jitter", dag, key),
    )


def exception_names(values: Any, what: str, dag: str, key: str) -> tuple[str, ...]:
    """``retry_on`` / ``no_retry_on``: exception classes (as their qualified names) or class names."""
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise ValidationError(f"{what} must be a list of exception classes or class names", dag=dag, node=key)
    names = []
    for v in values:
        if isinstance(v, str):
            names.append(v)
        elif isinstance(v, type) and issubclass(v, BaseException):
            names.append(f"{v.__module__}.{v.__qualname__}")
        else:
            raise ValidationError(
                f"{what} must list exception classes or class names, not {short(v)}", dag=dag, node=key
            )
    return tuple(names)


def resource_names(values: Any, dag: str, key: str) -> tuple[str, ...]:
    """A node's resources, each once, in the order given."""
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise ValidationError("resources must be a list of resource names", dag=dag, node=key)
    names = tuple(values)
    problem = resources_problem(names)
    if problem:
        raise ValidationError(problem, dag=dag, node=key)
    return tuple(dict.fromkeys(names))


def map_args(
    over: Any, kwarg: str | None, upstream: Iterable[Node | str], dag: str, key: str
) -> tuple[tuple[MapArg, ...], list[Node | str]]:
    """:meth:`DAG.map`'s ``over`` (with ``kwarg``) as mapped arguments, and the node's parents:
    ``upstream`` and every node mapped over, each once."""
    if isinstance(over, Mapping):
        if kwarg is not None:
            raise ValidationError(
                "kwarg names the mapped argument of a single 'over'; with a mapping, its keys are the keywords",
                dag=dag,
                node=key,
            )
        pairs = list(over.items())
        if not pairs:
            raise ValidationError("over is an empty mapping: name the mapped arguments", dag=dag, node=key)
    else:
        if kwarg is None:
            raise ValidationError("kwarg is required: the keyword each item is passed as", dag=dag, node=key)
        pairs = [(kwarg, over)]
    args: list[MapArg] = []
    if isinstance(upstream, (str, bytes, Mapping)) or not isinstance(upstream, Iterable):
        raise ValidationError("upstream must be a list of nodes or node keys", dag=dag, node=key)
    parents: list[Node | str] = list(upstream)
    for name, source in pairs:
        if isinstance(source, Node):
            source = source.key
        if isinstance(source, str):
            args.append(MapArg(kwarg=name, source=source))
            if source not in [p.key if isinstance(p, Node) else p for p in parents]:
                parents.append(source)
        elif isinstance(source, (list, tuple)):
            args.append(MapArg(kwarg=name, items=tuple(source)))
        else:
            raise ValidationError(
                f"over[{name!r}] must be a node, a node key or a list, not {type(source).__name__}",
                dag=dag,
                node=key,
            )
    return tuple(args), parents


def transform_name(transform: Any, dag: str, key: str) -> str | None:
    """A map's ``transform``: a Celery task object (its name) or a task name."""
    if transform is None or isinstance(transform, str):
        return transform
    name = getattr(transform, "name", None)
    if not isinstance(name, str) or not callable(getattr(transform, "run", None)):
        raise ValidationError(
            f"transform must be a registered Celery task or its name, not {type(transform).__name__}", dag=dag, node=key
        )
    return name
