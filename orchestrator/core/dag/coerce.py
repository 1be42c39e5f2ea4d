"""What the builder (:meth:`DAG.task`) accepts turned into a node's fields: a name into its enum
member, a backoff mapping into a :class:`Backoff`, exception classes into their names, resource
names deduplicated. Each raises :class:`ValidationError` naming the DAG and the node."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..backoff import Backoff, Jitter
from ..errors import ValidationError
from .bounds import resources_problem, short


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
