"""The DAG registry: register a DAG once, run it by name, every run pinned to its version.

``Orchestrator.dags`` (:class:`DagRegistry`; ``orchestrator.register`` and
``orchestrator.submit_registered`` on the default orchestrator; ``orchestrator dag register |
versions | show | diff | pause | unpause | list`` on the command line):

* :meth:`DagRegistry.register` validates a DAG as a submit would (its tasks registered, its
  queues, limits and tenant) and stores its definition (the spec, without its tenant) under its
  name for its tenant. The version is bumped only when the content changes: registering the
  content the latest version holds returns that version (``created`` false), whatever order its
  nodes were built in (the content hash is the SHA-256 of the spec in canonical form: nodes in
  key order, object keys sorted). Content that differs from the latest is ``latest + 1``, even if
  an older version held it (going back is a new version: the history reads in order). Two
  processes registering at once make one version (the DAG row is locked).
* :meth:`DagRegistry.submit` (``submit_registered``) runs the latest version or the one given,
  with ``params`` laid over the DAG's own; the run records ``dag_version`` (``status --json``, the
  run page, ``runs --dag NAME --version N``). A rerun keeps its run's version.
* Names and versions are per tenant: another tenant's DAG is "not found" (:class:`DagNotFound`,
  :class:`DagVersionNotFound`).
* :meth:`DagRegistry.pause`: schedules (and events) start no run of a paused DAG, their firings
  recorded as skipped (``dag_paused``); a submit by hand still runs, with a warning that says so.
* :func:`diff`: what changed between two versions (DAG fields; nodes and edges added, removed,
  changed field by field).
"""

from __future__ import annotations

import builtins
import datetime as dt
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..core.dag import DAG, dag_from_spec, text_problem
from ..core.errors import DagNotFound, DagVersionNotFound, ValidationError
from ..core.routing import DEFAULT_TENANT
from ..store.submission import canonical_snapshot

if TYPE_CHECKING:
    from ..store import Store

#: a ``NAME@N`` reference's separator (``submit --dag etl@3``)
VERSION_SEP = "@"


def definition(dag: DAG) -> dict[str, Any]:
    """What a version stores: the DAG's spec without its tenant (the registry's key holds it)."""
    spec: dict[str, Any] = json.loads(json.dumps(dag.to_spec()))
    spec.pop("tenant", None)
    return spec


def content_hash(spec: Mapping[str, Any]) -> str:
    """The SHA-256 of a definition in canonical form (nodes in key order, keys sorted)."""
    return hashlib.sha256(canonical_snapshot(dict(spec)).encode()).hexdigest()


def parse_ref(ref: str) -> tuple[str, int | None]:
    """``NAME`` or ``NAME@N`` -> ``(name, version or None)``; a bad reference: ValidationError."""
    if not isinstance(ref, str) or not ref:
        raise ValidationError("a registered DAG is named NAME or NAME@VERSION")
    name, sep, number = ref.rpartition(VERSION_SEP)
    if not sep:
        return ref, None
    return name, check_version(number)


def check_version(number: Any) -> int:
    """A version number (1, 2, ...) from an int or its text; anything else: ValidationError."""
    if isinstance(number, bool):
        raise ValidationError(f"a DAG version is a number from 1, not {number!r}")
    if isinstance(number, str) and number.strip().isdigit():
        number = int(number.strip())
    if not isinstance(number, int) or number < 1:
        raise ValidationError(f"a DAG version is a number from 1, not {str(number)[:40]!r}")
    return number


@dataclass(frozen=True)
class DagVersion:
    """One version of a registered DAG (``spec``: its definition, without the tenant;
    ``created``: whether the registration that returned it made it)."""

    name: str
    tenant: str
    version: int
    content_hash: str
    registered_at: dt.datetime | None
    registered_by: str | None
    spec: dict[str, Any] | None = None
    created: bool = False

    def dag(self) -> DAG:
        """The version as a DAG of its tenant."""
        if self.spec is None:
            raise ValueError("this listing holds no spec: read the version with DagRegistry.version")
        return dag_from_spec({**self.spec, "tenant": self.tenant})

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "tenant": self.tenant,
            "version": self.version,
            "content_hash": self.content_hash,
            "registered_at": self.registered_at.isoformat() if self.registered_at else None,
            "registered_by": self.registered_by,
        }
        if self.spec is not None:
            out["spec"] = self.spec
        return out


@dataclass(frozen=True)
class RegisteredDag:
    """A registered DAG: its newest version and whether it is paused."""

    name: str
    tenant: str
    latest_version: int
    paused: bool
    paused_at: dt.datetime | None
    paused_by: str | None
    created_at: dt.datetime
    updated_at: dt.datetime

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "tenant": self.tenant,
            "latest_version": self.latest_version,
            "paused": self.paused,
            "paused_at": self.paused_at.isoformat() if self.paused_at else None,
            "paused_by": self.paused_by,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
        }


@dataclass(frozen=True)
class DagDiff:
    """What changed from version ``a`` to ``b``: DAG fields (``{field: (old, new)}``), nodes
    added and removed (keys), nodes changed (``{key: {field: (old, new)}}``) and edges added and
    removed (``(parent, child)``)."""

    name: str
    a: int
    b: int
    fields: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    nodes_added: list[str] = field(default_factory=list)
    nodes_removed: list[str] = field(default_factory=list)
    nodes_changed: dict[str, dict[str, tuple[Any, Any]]] = field(default_factory=dict)
    edges_added: list[tuple[str, str]] = field(default_factory=list)
    edges_removed: list[tuple[str, str]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (
            self.fields or self.nodes_added or self.nodes_removed or self.nodes_changed
            or self.edges_added or self.edges_removed
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "a": self.a,
            "b": self.b,
            "fields": {k: _pair(*v) for k, v in self.fields.items()},
            "nodes": {
                "added": self.nodes_added,
                "removed": self.nodes_removed,
                "changed": {k: {f: _pair(*v) for f, v in c.items()} for k, c in self.nodes_changed.items()},
            },
            "edges": {
                "added": [list(e) for e in self.edges_added],
                "removed": [list(e) for e in self.edges_removed],
            },
        }

    def lines(self) -> list[str]:
        """The diff as text: ``~`` a changed field or node, ``+`` added, ``-`` removed."""
        out = [f"{self.name} v{self.a} -> v{self.b}"]
        for k, (old, new) in self.fields.items():
            out.append(f"~ dag {k}: {_show(old)} -> {_show(new)}")
        out += [f"+ node {k}" for k in self.nodes_added]
        out += [f"- node {k}" for k in self.nodes_removed]
        for k, changes in self.nodes_changed.items():
            out.append(f"~ node {k}: " + "; ".join(f"{f} {_show(o)} -> {_show(n)}" for f, (o, n) in changes.items()))
        out += [f"+ edge {p} -> {c}" for p, c in self.edges_added]
        out += [f"- edge {p} -> {c}" for p, c in self.edges_removed]
        if self.empty:
            out.append("no differences")
        return out


def _pair(old: Any, new: Any) -> dict[str, Any]:
    return {"old": old, "new": new}


def _show(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _nodes(spec: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    plain = json.loads(canonical_snapshot(dict(spec)))
    return {str(n["key"]): n for n in plain.get("nodes", []) if isinstance(n, dict)}


def _edges(nodes: Mapping[str, Mapping[str, Any]]) -> set[tuple[str, str]]:
    return {(str(p), k) for k, n in nodes.items() for p in n.get("upstream") or ()}


def diff(name: str, a: int, spec_a: Mapping[str, Any], b: int, spec_b: Mapping[str, Any]) -> DagDiff:
    """What changed from ``spec_a`` (version ``a``) to ``spec_b``: fields compared as JSON; a
    node's ``upstream`` is reported as edges, not as a changed field."""
    old, new = _nodes(spec_a), _nodes(spec_b)
    plain_a, plain_b = json.loads(canonical_snapshot(dict(spec_a))), json.loads(canonical_snapshot(dict(spec_b)))
    fields = {
        k: (plain_a.get(k), plain_b.get(k))
        for k in sorted(set(plain_a) | set(plain_b) - {"nodes"})
        if k != "nodes" and plain_a.get(k) != plain_b.get(k)
    }
    changed: dict[str, dict[str, tuple[Any, Any]]] = {}
    for key in sorted(set(old) & set(new)):
        before, after = old[key], new[key]
        found = {
            f: (before.get(f), after.get(f))
            for f in sorted(set(before) | set(after))
            if f != "upstream" and before.get(f) != after.get(f)
        }
        if found:
            changed[key] = found
    edges_a, edges_b = _edges(old), _edges(new)
    return DagDiff(
        name, a, b, fields,
        nodes_added=sorted(set(new) - set(old)), nodes_removed=sorted(set(old) - set(new)), nodes_changed=changed,
        edges_added=sorted(edges_b - edges_a), edges_removed=sorted(edges_a - edges_b),
    )  # fmt: skip


def _version(row: Any, *, created: bool = False, with_spec: bool = True) -> DagVersion:
    return DagVersion(
        name=row.name, tenant=row.tenant, version=row.version, content_hash=row.content_hash,
        registered_at=row.registered_at, registered_by=row.registered_by,
        spec=dict(row.spec) if with_spec else None, created=created,
    )  # fmt: skip


def _registered(row: Any) -> RegisteredDag:
    return RegisteredDag(
        name=row.name, tenant=row.tenant, latest_version=row.latest_version, paused=bool(row.paused),
        paused_at=row.paused_at, paused_by=row.paused_by, created_at=row.created_at, updated_at=row.updated_at,
    )  # fmt: skip


class RegistryPort(Protocol):
    """What :class:`DagRegistry` needs of its orchestrator (an
    :class:`~orchestrator.engine.facade.Orchestrator`, which builds it: a Protocol, so that this module
    does not import the engine back)."""

    @property
    def tenant(self) -> str | None: ...

    @property
    def store(self) -> Store: ...

    def check(self, dag: DAG, *, tenant: str | None = None) -> DAG: ...

    def submit(self, dag: DAG, *, idempotency_key: str | None = None, dag_version: int | None = None) -> Any: ...


class DagRegistry:
    """``Orchestrator.dags``: the registry as this orchestrator sees it (bound to a tenant: that
    tenant's DAGs only; unbound: ``tenant=`` or ``default``)."""

    def __init__(self, orc: RegistryPort) -> None:
        self.orc = orc
        self.rows = orc.store.dags

    def _tenant(self, tenant: str | None) -> str:
        bound = self.orc.tenant
        if bound is not None:
            if tenant is not None and tenant not in (bound, DEFAULT_TENANT):
                raise ValidationError(f"this orchestrator acts as tenant {bound!r}; it cannot use tenant {tenant!r}")
            return bound
        return tenant or DEFAULT_TENANT

    @staticmethod
    def _name(name: Any) -> str:
        problem = text_problem(name, 200) if isinstance(name, str) else f"must be a string, not {type(name).__name__}"
        if problem:
            raise ValidationError(f"DAG name {problem}")
        return str(name)

    def register(self, dag: DAG, *, tenant: str | None = None, by: str | None = None) -> DagVersion:
        """Validate ``dag`` as :meth:`Orchestrator.submit` would and store it as the newest
        version of its name for its tenant, unless the latest version holds the same content
        (then that version, ``created`` false). Raises :class:`ValidationError` (nothing
        stored) for a DAG that would not submit."""
        if not isinstance(dag, DAG):
            raise ValidationError(f"register takes a DAG, not {type(dag).__name__}")
        dag = self.orc.check(dag, tenant=tenant)
        spec = definition(dag)
        digest = content_hash(spec)
        version, created = self.rows.register(dag.tenant, dag.name, spec, digest, by)
        found = self.rows.version(dag.tenant, dag.name, version)
        return _version(found, created=created)

    def get(self, name: str, *, tenant: str | None = None) -> RegisteredDag:
        """The registered DAG ``name``; raises :class:`DagNotFound`."""
        owner = self._tenant(tenant)
        row = self.rows.get(owner, self._name(name))
        if row is None:
            raise DagNotFound(f"no registered DAG named {name!r} for tenant {owner!r}")
        return _registered(row)

    def list(self, *, tenant: str | None = None) -> builtins.list[RegisteredDag]:
        """The registered DAGs (a bound orchestrator: its tenant's; else ``tenant``'s, or every
        tenant's when None)."""
        owner = self.orc.tenant or tenant
        return [_registered(r) for r in self.rows.all(owner)]

    def version(self, name: str, version: int | None = None, *, tenant: str | None = None) -> DagVersion:
        """A version with its definition (None: the latest); raises :class:`DagNotFound` or
        :class:`DagVersionNotFound`."""
        found = self.get(name, tenant=tenant)
        number = None if version is None else check_version(version)
        row = self.rows.version(found.tenant, found.name, number)
        if row is None:
            raise DagVersionNotFound(
                f"DAG {name!r} has no version {number} (its versions: 1 to {found.latest_version})"
            )
        return _version(row)

    def versions(self, name: str, *, tenant: str | None = None) -> builtins.list[DagVersion]:
        """Every version of ``name``, oldest first (without their definitions)."""
        found = self.get(name, tenant=tenant)
        return [_version(r, with_spec=False) for r in self.rows.versions(found.tenant, found.name)]

    def diff(self, name: str, a: int, b: int, *, tenant: str | None = None) -> DagDiff:
        """What changed from version ``a`` to ``b``."""
        va, vb = self.version(name, a, tenant=tenant), self.version(name, b, tenant=tenant)
        return diff(va.name, va.version, va.spec or {}, vb.version, vb.spec or {})

    def pause(self, name: str, *, tenant: str | None = None, by: str | None = None) -> RegisteredDag:
        """Schedules and events start no run of ``name`` until :meth:`unpause` (a submit by hand
        still does). Raises :class:`DagNotFound`."""
        return self._set_paused(name, True, tenant, by)

    def unpause(self, name: str, *, tenant: str | None = None, by: str | None = None) -> RegisteredDag:
        return self._set_paused(name, False, tenant, by)

    def _set_paused(self, name: str, paused: bool, tenant: str | None, by: str | None) -> RegisteredDag:
        found = self.get(name, tenant=tenant)
        row = self.rows.set_paused(found.tenant, found.name, paused, by)
        if row is None:
            raise DagNotFound(f"no registered DAG named {name!r} for tenant {found.tenant!r}")
        return _registered(row)

    def is_paused(self, name: str, tenant: str) -> bool:
        """Whether ``name`` is registered for ``tenant`` and paused (not registered: False)."""
        return self.rows.is_paused(tenant, name)

    def build(
        self, name: str, version: int | None = None, *, params: Mapping[str, Any] | None = None,
        tenant: str | None = None,
    ) -> tuple[DAG, DagVersion]:  # fmt: skip
        """The DAG of a version (``params`` laid over its own), and the version."""
        found = self.version(name, version, tenant=tenant)
        dag = found.dag()
        if params is not None:
            if not isinstance(params, Mapping):
                raise ValidationError(f"params must be a mapping, not {type(params).__name__}", dag=name)
            dag.params = {**dag.params, **params}
        return dag, found

    def submit(
        self,
        name: str,
        version: int | None = None,
        *,
        params: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
        tenant: str | None = None,
    ) -> Any:
        """A run (its ``RunHandle``) of the registered DAG ``name`` at ``version`` (None: the latest), its params
        laid over with ``params``; the run records the version. Raises :class:`DagNotFound`,
        :class:`DagVersionNotFound`, or what :meth:`Orchestrator.submit` raises."""
        dag, found = self.build(name, version, params=params, tenant=tenant)
        return self.orc.submit(dag, idempotency_key=idempotency_key, dag_version=found.version)
