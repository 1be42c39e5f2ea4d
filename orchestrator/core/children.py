"""Child runs (pure code): a node that starts a DAG and waits for it as a row.

``dag.run_dag(key, dag="etl@3", params={...}, wait=True, on_parent_end="cancel")`` adds a node
that runs on no worker. When its trigger rule says READY it becomes ``WAITING`` (``orc_wait_v1``,
kind ``child``: no slot, no message); the engine's child pass then submits the child run, once per
(parent run, node key, attempt) — the child's idempotency key says so — and links the two in the
child's submit transaction. When the child run ends, the node ends with it: SUCCEEDED with the
child's results (its leaf tasks' results by key), or, for a child that FAILED or was CANCELLED,
a new child on the node's next attempt while attempts are left, else FAILED.

The DAG the child runs is one of: a registered DAG (``"name"`` (its latest version when the child
starts) or ``"name@N"``), a :class:`~orchestrator.core.dag.DAG` object or an inline spec (a
mapping in the spec format); a DAG object is kept as its spec, so the child can be built later
from the database alone. ``params`` are laid over the child DAG's own.

``wait=False``: the node succeeds as soon as the child run is stored, its result ``{"run_id": ...}``.
``on_parent_end``: ``"cancel"`` (default) cancels a running child when its parent node stops
waiting for it (the parent run cancelled, the node cleared, marked or cancelled; with
``wait=False``, the parent run cancelled or the node cleared); ``"abandon"`` leaves it running.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ValidationError

#: the task name of a child-run node (it never runs on a worker)
CHILD_TASK = "orchestrator.run_dag"
ON_PARENT_END = ("cancel", "abandon")
#: a registered DAG's name as a child names it (``NAME`` or ``NAME@N``)
REF_RE = re.compile(r"([A-Za-z0-9][A-Za-z0-9._:/-]{0,199})(?:@([1-9][0-9]{0,8}))?")
#: the most bytes of JSON a child's params, and an inline spec, may hold on the parent's row
MAX_PARAMS_BYTES = 64 * 1024
MAX_SPEC_BYTES = 1024 * 1024
CHILD_FIELDS = {"dag", "params", "wait", "on_parent_end"}
#: the longest idempotency key a run holds (``core.dag.bounds.MAX_IDEMPOTENCY_KEY_CHARS``)
MAX_KEY_CHARS = 200


def _fail(message: str, where: tuple[str | None, str | None]) -> ValidationError:
    return ValidationError(message, dag=where[0], node=where[1])


def _json_size(value: Any, what: str, limit: int, where: tuple[str | None, str | None]) -> None:
    try:
        size = len(json.dumps(value, separators=(",", ":"), allow_nan=False).encode())
    except (TypeError, ValueError, RecursionError) as exc:
        raise _fail(f"{what} must be plain JSON ({type(exc).__name__}: {str(exc)[:80]})", where) from None
    if size > limit:
        raise _fail(f"{what} is {size} bytes of JSON; at most {limit}", where)


def idempotency_key(run_id: str, key: str, attempt: int) -> str:
    """The child run's idempotency key: one child per (parent run, node key, attempt); a key too
    long for the column (``orc_runs.idempotency_key``, 200 characters) is named by its hash."""
    plain = f"child:{run_id}:{key}:{attempt}"
    if len(plain) <= MAX_KEY_CHARS:
        return plain
    return f"child:{run_id}:{hashlib.sha256(key.encode()).hexdigest()[:40]}:{attempt}"


@dataclass(frozen=True)
class ChildSpec:
    """What a child-run node starts: a registered DAG (``name``, ``version`` or None: the latest
    when the child starts) or an inline ``spec``; ``params``, ``wait``, ``on_parent_end``."""

    name: str | None = None
    version: int | None = None
    spec: Mapping[str, Any] | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    wait: bool = True
    on_parent_end: str = "cancel"

    @classmethod
    def make(
        cls, dag: Any, *, params: Any = None, wait: Any = True, on_parent_end: Any = "cancel",
        where: tuple[str | None, str | None] = (None, None),
    ) -> ChildSpec:  # fmt: skip
        """``dag``: ``"name"`` / ``"name@N"``, a DAG object (kept as its spec, validated now) or
        a spec mapping. Raises :class:`ValidationError` naming the node."""
        if on_parent_end not in ON_PARENT_END:
            raise _fail(f"on_parent_end must be 'cancel' or 'abandon', not {str(on_parent_end)[:40]!r}", where)
        if not isinstance(wait, bool):
            raise _fail(f"wait must be true or false, not {str(wait)[:40]!r}", where)
        if params is None:
            params = {}
        if not isinstance(params, Mapping) or not all(isinstance(k, str) for k in params):
            raise _fail(f"params must be a mapping with string keys, not {type(params).__name__}", where)
        _json_size(dict(params), "params", MAX_PARAMS_BYTES, where)
        name: str | None = None
        version: int | None = None
        spec: dict[str, Any] | None = None
        if isinstance(dag, str):
            found = REF_RE.fullmatch(dag)
            if found is None:
                raise _fail(f"dag must be a registered DAG's NAME or NAME@VERSION, not {dag[:60]!r}", where)
            name, version = found.group(1), int(found.group(2)) if found.group(2) else None
        elif isinstance(dag, Mapping):
            spec = dict(dag)
        elif callable(getattr(dag, "to_spec", None)) and callable(getattr(dag, "validate", None)):
            dag.validate()  # a DAG object: judged now, kept as its spec
            spec = dag.to_spec()
        else:
            raise _fail(
                f"dag must be a registered DAG's name ('etl' or 'etl@3'), a DAG or a spec mapping, not"
                f" {type(dag).__name__}",
                where,
            )
        if spec is not None:
            _json_size(spec, "the child DAG's spec", MAX_SPEC_BYTES, where)
            if not isinstance(spec.get("name"), str):
                raise _fail("the child DAG's spec needs a 'name'", where)
        return cls(name=name, version=version, spec=spec, params=dict(params), wait=wait, on_parent_end=on_parent_end)

    def checked(self, where: tuple[str | None, str | None] = (None, None)) -> ChildSpec:
        """This spec, if :meth:`make` would build it; raises :class:`ValidationError`."""
        ref: Any = self.spec if self.spec is not None else self.ref
        if (self.spec is None) == (self.name is None):
            raise _fail("a child run names a registered DAG or holds a spec, one of them", where)
        made = ChildSpec.make(ref, params=self.params, wait=self.wait, on_parent_end=self.on_parent_end, where=where)
        if made != self:
            raise _fail(f"a hand-built ChildSpec must be as ChildSpec.make builds it: {self!r}"[:300], where)
        return made

    @property
    def ref(self) -> str | None:
        """``name`` or ``name@N`` for a registered DAG; None for an inline spec."""
        if self.name is None:
            return None
        return self.name if self.version is None else f"{self.name}@{self.version}"

    def describe(self) -> str:
        return f"registered DAG {self.ref}" if self.name is not None else f"DAG {(self.spec or {}).get('name')!r}"

    def to_spec(self) -> dict[str, Any]:
        """The spec format's ``run_dag`` field."""
        out: dict[str, Any] = {"dag": self.ref if self.name is not None else dict(self.spec or {})}
        if self.params:
            out["params"] = dict(self.params)
        if not self.wait:
            out["wait"] = False
        if self.on_parent_end != "cancel":
            out["on_parent_end"] = self.on_parent_end
        return out

    def to_row(self) -> dict[str, Any]:
        """The task row's ``wait_spec`` (kind ``child``: ``orc_wait_v1`` makes it WAITING)."""
        return {
            "kind": "child", "name": self.name, "version": self.version, "spec": self.spec,
            "params": dict(self.params), "wait": self.wait, "on_parent_end": self.on_parent_end,
        }  # fmt: skip

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> ChildSpec:
        return cls(
            name=row.get("name"), version=row.get("version"), spec=row.get("spec"), params=row.get("params") or {},
            wait=bool(row.get("wait", True)), on_parent_end=str(row.get("on_parent_end", "cancel")),
        )  # fmt: skip


def child_from_spec(raw: Any, where: tuple[str | None, str | None]) -> ChildSpec:
    """A node's ``run_dag`` field: ``{"dag": "etl@3" | {spec}, "params", "wait", "on_parent_end"}``."""
    if not isinstance(raw, Mapping) or "dag" not in raw:
        raise _fail("'run_dag' must be a mapping with 'dag' (NAME, NAME@N or a DAG spec)", where)
    bad = set(raw) - CHILD_FIELDS
    if bad:
        raise _fail(f"unknown field(s) of 'run_dag' {sorted(map(str, bad))}", where)
    return ChildSpec.make(
        raw["dag"], params=raw.get("params"), wait=raw.get("wait", True),
        on_parent_end=raw.get("on_parent_end", "cancel"), where=where,
    )  # fmt: skip
