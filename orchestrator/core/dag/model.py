"""The values a DAG is made of: a :class:`Node` (one task), a :class:`MapSpec` (how a mapped node
becomes its children) with its :class:`MapArg` arguments, and :class:`OnDeadline`. Frozen; each
renders itself in the spec format (``to_spec``) and a map as its task row's ``map_spec``."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..backoff import Backoff
from ..children import ChildSpec
from ..routing import Priority
from ..states import TriggerRule
from ..waits import SensorSpec, WaitSpec
from . import bounds
from .bounds import DEFAULT_MAX_MAP_LENGTH


class OnDeadline(enum.StrEnum):
    """What a missed deadline does besides its ledger event and its alert."""

    #: nothing else: the run goes on
    ALERT = "alert"
    #: the reconciler cancels the run (its open tasks become CANCELLED, attempts in flight are revoked)
    CANCEL = "cancel"


#: the ``kwarg`` of a :class:`MapArg` whose items are each a mapping of keyword arguments
KWARGS = "**"


class _NoFill:
    """``zip_fill``'s default: no padding (a zip ends with its shortest argument)."""

    def __repr__(self) -> str:
        return "NO_FILL"

    def __reduce__(self) -> str:
        return "NO_FILL"


NO_FILL: Any = _NoFill()
#: the kwargs key of a mapped node's row that tells the worker to finish each child's item (apply
#: the map's transform, spread a ``kwargs_from`` item given at claim time); never a user's keyword
MAP_MARK = "__orc_map__"


@dataclass(frozen=True)
class MapArg:
    """One mapped keyword argument: each child gets one item of ``source``'s result (a node key)
    or of ``items`` (a literal list) as ``kwarg``; with ``kwarg`` :data:`KWARGS` (``kwargs_from``,
    Airflow's ``expand_kwargs``) each item is a mapping of keyword arguments."""

    kwarg: str
    source: str | None = None
    items: tuple[Any, ...] | None = None

    def to_spec(self) -> Any:
        return self.source if self.source is not None else list(self.items or ())


@dataclass(frozen=True)
class MapSpec:
    """How a mapped node becomes its children (``DAG.map``): its mapped arguments, how several
    combine (``zip`` or ``product``), the item field that names each child (``map_key``; by
    default the item's index, or a dict's keys), what an empty input does (``on_empty``), the
    most children (``max_length``) and the most of them QUEUED or RUNNING at once
    (``max_active``). A node mapped over another mapped node maps item by item
    (:meth:`DAG.per_item`). Airflow's forms: ``zip_fill`` pads a zip to its longest argument,
    ``items="pairs"`` maps a mapping to ``[key, value]`` pairs, ``skip_none`` drops ``None``
    items, ``transform`` (a registered task's function) turns each item before the child gets it,
    and a :data:`KWARGS` argument spreads each item as keyword arguments."""

    args: tuple[MapArg, ...]
    combine: str | None = None
    map_key: str | None = None
    on_empty: str = "skip"
    max_length: int = DEFAULT_MAX_MAP_LENGTH
    max_active: int | None = None
    zip_fill: Any = NO_FILL
    items: str = "values"
    skip_none: bool = False
    transform: str | None = None

    def to_spec(self) -> dict[str, Any]:
        """The spec format's ``map`` field."""
        spec: dict[str, Any]
        if len(self.args) == 1 and self.args[0].kwarg == KWARGS:
            spec = {"kwargs_from": self.args[0].to_spec()}
        elif len(self.args) == 1:
            spec = {"over": self.args[0].to_spec(), "kwarg": self.args[0].kwarg}
        else:
            spec = {"over": {a.kwarg: a.to_spec() for a in self.args}}
        if self.combine is not None:
            spec["combine"] = self.combine
        if self.map_key is not None:
            spec["map_key"] = self.map_key
        if self.on_empty != "skip":
            spec["on_empty"] = self.on_empty
        if self.max_length != DEFAULT_MAX_MAP_LENGTH:
            spec["max_length"] = self.max_length
        if self.max_active is not None:
            spec["max_active"] = self.max_active
        if self.zip_fill is not NO_FILL:
            spec["zip_fill"] = self.zip_fill
        if self.items != "values":
            spec["items"] = self.items
        if self.skip_none:
            spec["skip_none"] = True
        if self.transform is not None:
            spec["transform"] = self.transform
        return spec

    def to_row(self, per_item: str | None, decides: bool = True) -> dict[str, Any]:
        """The task row's ``map_spec`` (what ``orc_expand_v1`` reads); ``per_item``: the mapped
        node this one maps item by item over; ``decides``: whether a failed child fails the run
        (not under ``run_state="leaves"`` for a map that is no leaf)."""
        row: dict[str, Any] = {
            "args": [
                {"kwarg": a.kwarg, "from": a.source} if a.source is not None
                else {"kwarg": a.kwarg, "items": list(a.items or ())}
                for a in self.args
            ],
            "combine": self.combine or "zip",
            "on_empty": self.on_empty,
            "max_length": self.max_length,
            "window": bounds.MAP_WINDOW,  # at call time: a test narrows it
        }  # fmt: skip
        if self.map_key is not None:
            row["map_key"] = self.map_key
        if self.max_active is not None:
            row["max_active"] = self.max_active
        if per_item is not None:
            row["per_item"] = per_item
        if self.zip_fill is not NO_FILL:
            row["fill"] = {"v": self.zip_fill}
        if self.items != "values":
            row["items"] = self.items
        if self.skip_none:
            row["skip_none"] = True
        if self.transform is not None:
            row["transform"] = self.transform
        if not decides:
            row["decides"] = False
        return row

    def worker_mark(self, per_item: bool) -> dict[str, Any] | None:
        """What the worker finishes of each child's item (the :data:`MAP_MARK` entry of the node's
        row kwargs): the transform, and a ``kwargs_from`` item spread there when it is applied first
        or the item comes at claim time (a map item by item); ``None`` when the expansion gives
        each child its final keyword arguments."""
        kwarg = self.args[0].kwarg
        if self.transform is None and not (kwarg == KWARGS and per_item):
            return None
        return {"kwarg": kwarg, "transform": self.transform}


@dataclass(frozen=True)
class Node:
    """One task of a DAG: a registered Celery task name and its JSON arguments."""

    key: str
    task: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    upstream: tuple[str, ...] = ()
    trigger_rule: TriggerRule = TriggerRule.ALL_SUCCESS
    max_attempts: int = 1
    backoff: Backoff = field(default_factory=Backoff)
    soft_time_limit: float | None = None
    time_limit: float | None = None
    priority: Priority | None = None
    queue: str | None = None
    #: exception class names (bare or qualified) that may be retried; empty: all
    retry_on: tuple[str, ...] = ()
    #: exception class names that fail the task at once
    no_retry_on: tuple[str, ...] = ()
    #: the named pool whose slots the task holds while QUEUED or RUNNING (``orchestrator pool set``)
    pool: str | None = None
    #: how many of the pool's slots it holds
    pool_slots: int = 1
    #: the deployment-wide token bucket each attempt takes a token of (``orchestrator limit set``)
    rate_limit: str | None = None
    #: the resources the task uses, each with its circuit breaker (``orchestrator breaker set``);
    #: ``{tenant}`` in a name becomes the run's tenant at submit
    resources: tuple[str, ...] = ()
    #: seconds after the run's logical date (or its submit) by which the task must be done
    deadline: float | None = None
    #: a mapped node (``DAG.map``): it becomes one child per item
    map: MapSpec | None = None
    #: the task's result names the direct children to follow (the others are SKIPPED)
    branch: bool = False
    #: a falsy result skips everything downstream
    short_circuit: bool = False
    #: with ``short_circuit``: ``False`` (Airflow's option) skips only the direct children and lets
    #: the tasks below follow their own trigger rules
    ignore_downstream_trigger_rules: bool = True
    #: Airflow's setup and teardown tasks; a teardown decides its run's state only with ``fails_run``
    setup: bool = False
    teardown: bool = False
    fails_run: bool = False
    #: the body runs in the transaction that commits its success (``current_context().transaction``)
    transactional: bool = False
    #: all_success relaxed: READY once this share of the upstream (a map's children) succeeded
    min_success_ratio: float | None = None
    #: a wait node (``DAG.wait``, ``DAG.approval``): it never runs on a worker, it waits (WAITING)
    wait: WaitSpec | None = None
    #: a sensor (``DAG.sensor``): its check task runs until it returns something truthy
    sensor: SensorSpec | None = None
    #: a child-run node (``DAG.run_dag``): it starts a DAG and waits for it (WAITING), on no worker
    child: ChildSpec | None = None

    def to_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "key": self.key,
            "task": self.task,
            "args": list(self.args),
            "kwargs": dict(self.kwargs),
            "upstream": list(self.upstream),
            # a StrEnum member is its value as JSON; no .value lookup per node
            "trigger_rule": self.trigger_rule,
            "max_attempts": self.max_attempts,
            "backoff": self.backoff.to_spec(),
        }
        if self.soft_time_limit is not None:
            spec["soft_time_limit"] = self.soft_time_limit
        if self.time_limit is not None:
            spec["time_limit"] = self.time_limit
        if self.queue is not None:
            spec["queue"] = self.queue
        if self.priority is not None:
            spec["priority"] = self.priority.value
        if self.retry_on:
            spec["retry_on"] = list(self.retry_on)
        if self.no_retry_on:
            spec["no_retry_on"] = list(self.no_retry_on)
        if self.pool is not None:
            spec["pool"] = self.pool
            if self.pool_slots != 1:
                spec["pool_slots"] = self.pool_slots
        if self.rate_limit is not None:
            spec["rate_limit"] = self.rate_limit
        if self.resources:
            spec["resources"] = list(self.resources)
        if self.deadline is not None:
            spec["deadline"] = self.deadline
        if self.map is not None:
            spec["map"] = self.map.to_spec()
        for flag in ("branch", "short_circuit", "setup", "teardown", "fails_run", "transactional"):
            if getattr(self, flag):
                spec[flag] = True
        if not self.ignore_downstream_trigger_rules:
            spec["ignore_downstream_trigger_rules"] = False
        if self.min_success_ratio is not None:
            spec["min_success_ratio"] = self.min_success_ratio
        if self.wait is not None:
            spec["wait"] = self.wait.to_spec()
        if self.sensor is not None:
            spec["sensor"] = self.sensor.to_spec()
        if self.child is not None:
            spec["run_dag"] = self.child.to_spec()
        return spec
