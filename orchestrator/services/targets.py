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
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ..core.cron import ScheduleError
from ..core.dag import DAG, TENANT_RE, dag_from_spec, load_spec, short
from ..core.errors import ValidationError
from ..core.routing import DEFAULT_TENANT
from ..store.schedules import iso

if TYPE_CHECKING:
    from .dag_registry import DagRegistry


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


class TargetPort(Protocol):
    """What resolving a target uses of the orchestrator (its tenant, its submit checks, its registry)."""

    @property
    def tenant(self) -> str | None: ...

    def check(self, dag: DAG, *, tenant: str | None = None) -> DAG: ...

    @property
    def dags(self) -> DagRegistry: ...


@dataclass(frozen=True)
class Target:
    """What a schedule or a trigger starts, for its ``tenant``: exactly one of a spec snapshot
    (templated per firing), a factory ``module:function`` or a registered DAG ``(name, version)``
    (``None``: its latest version each time)."""

    tenant: str
    spec: dict[str, Any] | None = None
    factory: str | None = None
    registered: tuple[str, int | None] | None = None


def snapshot(spec: Any, error: type[Exception]) -> dict[str, Any]:
    """A spec given as a file's path, a parsed spec or a :class:`DAG`, as the JSON stored for it;
    raises ``error`` (or the spec's own :class:`ValidationError`)."""
    if isinstance(spec, DAG):
        return spec.to_spec()
    if isinstance(spec, Mapping):
        dag_from_spec(spec)  # the shape, before anything else
        return json.loads(json.dumps(spec))  # type: ignore[no-any-return]
    if not isinstance(spec, (str, os.PathLike)):
        raise error(f"spec must be a spec file's path, a mapping or a DAG, not {type(spec).__name__}")
    p = Path(spec)
    if not p.is_file():
        raise error(f"spec file {str(p)!r} does not exist")
    return load_spec(p).to_spec()


def registered_spec(
    orc: TargetPort, ref: Any, tenant: str, error: type[Exception]
) -> tuple[tuple[str, int | None], dict[str, Any]]:
    """``NAME`` or ``NAME@N`` of a registered DAG of ``tenant``: the reference and the version's
    spec for that tenant; raises ``error``, :class:`DagNotFound` or :class:`DagVersionNotFound`."""
    from .dag_registry import parse_ref

    if not isinstance(ref, str):
        raise error(f"registered must be NAME or NAME@N, not {type(ref).__name__}")
    name, version = parse_ref(ref)
    found = orc.dags.version(name, version, tenant=tenant)
    spec = {**(found.spec or {}), "tenant": tenant}
    check_placeholders(spec)
    return (name, version), spec


def resolve(
    orc: TargetPort, *, spec: Any, dag: str | None, registered: Any, factory_modules: Iterable[str],
    build_spec: Callable[[dict[str, Any]], DAG], build_registered: Callable[[dict[str, Any]], DAG],
    error: type[Exception],
) -> Target:  # fmt: skip
    """The one target of a schedule's or a trigger's definition (exactly one of ``spec``, ``dag``,
    ``registered`` is given), checked as it would fire: the DAG ``build_spec`` (a spec) or
    ``build_registered`` (a registered DAG's spec) makes must pass every submit check for the
    target's tenant, a factory must be importable and declared. Raises ``error`` /
    :class:`ValidationError` naming the problem; writes nothing."""
    tenant = orc.tenant or DEFAULT_TENANT
    if spec is not None:
        snap = snapshot(spec, error)
        check_placeholders(snap)
        tenant = orc.tenant or str(snap.get("tenant") or DEFAULT_TENANT)
        orc.check(build_spec(snap), tenant=tenant)
        target = Target(tenant, spec=snap)
    elif registered is not None:
        ref, built = registered_spec(orc, registered, tenant, error)
        orc.check(build_registered(built), tenant=tenant)
        target = Target(tenant, registered=ref)
    else:
        assert dag is not None
        load_factory(dag, factory_modules)
        target = Target(tenant, factory=dag)
    if not TENANT_RE.fullmatch(tenant):
        raise ValidationError(f"tenant {tenant!r} must be 1-64 letters, digits, '_' or '-'")
    return target
