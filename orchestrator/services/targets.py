"""What a schedule or an event trigger starts, its target: a DAG spec templated per firing
(``{{ logical_date }}``, ``{{ ds }}``), a factory (``module:function``, allow-listed and marked with
:func:`dag_factory`) or a registered DAG by name. Schedules (:mod:`.scheduling`) and triggers
(:mod:`.triggers`) check, render and fingerprint their targets here, the one implementation."""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib
import inspect
import json
import re
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from ..core.cron import ScheduleError
from ..core.dag import (
    DAG,
    short,
)
from ..store.schedules import iso

if TYPE_CHECKING:
    pass


_PLACEHOLDER = re.compile(r"\{\{\s*([^{}]*?)\s*\}\}")

PLACEHOLDERS = ("logical_date", "ds")


def spec_hash(spec: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_placeholders(value: Any, where: str = "spec") -> None:
    """Refuse any ``{{ … }}`` but ``{{ logical_date }}`` and ``{{ ds }}``."""
    if isinstance(value, str):
        for m in _PLACEHOLDER.finditer(value):
            if m.group(1) not in PLACEHOLDERS:
                raise ScheduleError(
                    f"{where}: unknown placeholder {m.group(0)!r}; only {{{{ logical_date }}}} and {{{{ ds }}}} exist"
                )
    elif isinstance(value, Mapping):
        for k, v in value.items():
            check_placeholders(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_placeholders(v, f"{where}[{i}]")


def render(value: Any, logical_date: dt.datetime, zone: Any) -> Any:
    """``value`` with ``{{ logical_date }}`` and ``{{ ds }}`` replaced in every string."""
    fills = {"logical_date": iso(logical_date), "ds": logical_date.astimezone(zone).date().isoformat()}
    if isinstance(value, str):
        return _PLACEHOLDER.sub(lambda m: fills.get(m.group(1), m.group(0)), value)
    if isinstance(value, Mapping):
        return {k: render(v, logical_date, zone) for k, v in value.items()}
    if isinstance(value, list):
        return [render(v, logical_date, zone) for v in value]
    return value


#: the attribute :func:`dag_factory` sets on a function it declares a DAG factory
FACTORY_MARK = "__orchestrator_dag_factory__"

_FACTORY_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")

#: the modules factories may live in when no setting says (``ORCHESTRATOR_DAG_FACTORY_MODULES``)
DEFAULT_FACTORY_MODULES = ("tasks.dags",)

F = TypeVar("F", bound=Callable[..., Any])


def dag_factory(fn: F) -> F:
    """Declare ``fn(logical_date, params) -> DAG`` a DAG factory a schedule may run::

        from orchestrator import dag_factory

        @dag_factory
        def daily_etl(logical_date, params) -> DAG: ...

    A schedule's ``dag`` (``module:function``) must name a function so declared, in a module of
    ``ORCHESTRATOR_DAG_FACTORY_MODULES`` (default ``tasks.dags``; a listed package covers its
    submodules). Anything else (``builtins:eval``, ``shutil:rmtree``, an undeclared function)
    is refused with :class:`FactoryNotAllowed` when the schedule is added and again when it fires."""
    if not callable(fn):
        raise TypeError(f"@dag_factory decorates a function, not {type(fn).__name__}")
    setattr(fn, FACTORY_MARK, True)
    return fn


class FactoryNotAllowed(ScheduleError):
    """A schedule names a ``module:function`` that is not a declared DAG factory (not decorated
    with :func:`dag_factory`, or in a module ``ORCHESTRATOR_DAG_FACTORY_MODULES`` does not list):
    it is never called."""


def _module_allowed(module_name: str, modules: Iterable[str]) -> bool:
    return any(module_name == m or module_name.startswith(m + ".") for m in modules)


def load_factory(
    path: str, modules: Iterable[str] = DEFAULT_FACTORY_MODULES
) -> Callable[[dt.datetime, dict[str, Any]], DAG]:
    """The DAG factory ``module:function``: a function decorated with :func:`dag_factory` in a
    module ``modules`` lists (``ORCHESTRATOR_DAG_FACTORY_MODULES``). A module outside the list is
    not even imported. Raises :class:`FactoryNotAllowed` (not declared, or not allowed) or
    :class:`ScheduleError` (malformed, unimportable, wrong signature) naming what is wrong."""
    if not isinstance(path, str) or path.count(":") != 1:
        raise ScheduleError(f"factory {short(path)} must be module:function")
    if not _FACTORY_PATH.fullmatch(path):
        raise ScheduleError(f"factory {short(path)} must be module:function (Python names)")
    module_name, attr = path.split(":")
    modules = tuple(modules)
    if not _module_allowed(module_name, modules):
        raise FactoryNotAllowed(
            f"factory {path!r}: module {module_name!r} is not a DAG factory module (ORCHESTRATOR_DAG_FACTORY_MODULES"
            f" lists {', '.join(modules) or 'none'}); declare factories with @dag_factory in one of them"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - an import error of any kind is the user module's
        raise ScheduleError(f"factory {path!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc})") from None
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ScheduleError(f"factory {path!r}: {module_name} has no function {attr!r}")
    if getattr(fn, FACTORY_MARK, False) is not True or not inspect.isfunction(fn):
        raise FactoryNotAllowed(
            f"factory {path!r} is not a declared DAG factory: decorate it with @orchestrator.dag_factory"
        )
    try:
        inspect.signature(fn).bind(dt.datetime.now(dt.UTC), {})
    except TypeError:
        raise ScheduleError(f"factory {path!r} must accept (logical_date, params)") from None
    return fn
