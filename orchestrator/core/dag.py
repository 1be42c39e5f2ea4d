"""The DAG model, its validation and the spec file format (pure code).

A :class:`DAG` is built in code (``dag.task(key, signature, upstream=[...])``) or read from a
YAML/JSON spec (:func:`load_spec`). :meth:`DAG.validate` refuses bad input with a
:class:`~orchestrator.core.errors.ValidationError` naming the node, before anything is written.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .backoff import Backoff, Jitter
from .errors import CycleError, SpecError, UnknownTaskError, ValidationError
from .routing import Priority
from .states import TriggerRule
from .waits import WAIT_TASK, SensorSpec, WaitSpec, sensor_from_spec, wait_from_spec

# every pattern is matched with fullmatch(): "a\n" is not "a"
KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,200}")
TENANT_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
QUEUE_RE = re.compile(r"[A-Za-z0-9_.:-]{1,200}")
TASK_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]{0,254}")
#: pool names and rate limit keys
LIMIT_NAME_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
#: a resource's name as a node declares it: a breaker's name, where ``{tenant}`` may stand for
#: the run's tenant (expanded at submit)
RESOURCE_RE = re.compile(r"(?:[A-Za-z0-9_.:-]|\{tenant\})+")
#: the most resources one task may declare
MAX_RESOURCES = 16

#: the bounds of every number and size a DAG may carry (the spec's schema; see README)
MAX_ATTEMPTS = 1000
#: seconds: backoff base and cap
MAX_BACKOFF = 7 * 86400
#: seconds: the shortest time limit a node may ask for (a shorter one kills the body before it
#: can even claim); the longest is ORCHESTRATOR_MAX_TIME_LIMIT
MIN_TIME_LIMIT = 1.0
#: nesting of lists and objects in args, kwargs and params (a worker drops a message body
#: nested deeper than 64: see orchestrator.inbox)
MAX_JSON_DEPTH = 32
#: integers in args, kwargs and params: 64-bit signed
MAX_JSON_INT = 2**63 - 1
MAX_NAME_CHARS = 200
MAX_IDEMPOTENCY_KEY_CHARS = 200
MAX_LOGICAL_DATE_CHARS = 64
#: spec files larger than this are refused unread (bytes)
MAX_SPEC_BYTES = 16 * 1024 * 1024
#: slots one node may ask of its pool, and a pool's slots (``orchestrator pool set``)
MAX_POOL_SLOTS = 100_000
#: tasks of one run QUEUED or RUNNING at once (``max_active_tasks``)
MAX_ACTIVE_TASKS = 1_000_000
#: seconds: the longest deadline a DAG or a node may set (after the logical date, or the submit)
MAX_DEADLINE = 366 * 86400
#: Keyword under which a task that declares it receives its parents' results.
UPSTREAM_KWARG = "upstream"


class OnDeadline(enum.StrEnum):
    """What a missed deadline does besides its ledger event and its alert."""

    #: nothing else: the run goes on
    ALERT = "alert"
    #: the reconciler cancels the run (its open tasks become CANCELLED, attempts in flight are revoked)
    CANCEL = "cancel"


@dataclass(frozen=True)
class SizeLimits:
    """Size limits applied by :meth:`DAG.validate`; the defaults accept a 100,000-node DAG.
    (Not the store's ``limits`` role: pools, rate limits and per-DAG limits.)"""

    max_nodes: int = 100_000
    max_node_bytes: int = 64 * 1024
    max_params_bytes: int = 256 * 1024


#: the former name of :class:`SizeLimits` (public API: ``orchestrator.Limits``), kept for callers
Limits = SizeLimits


#: the default and the hard cap of a map's children (``max_map_length``; the cap is
#: ``ORCHESTRATOR_MAX_NODES``'s default)
DEFAULT_MAX_MAP_LENGTH = 10_000
MAX_MAP_LENGTH = 100_000
#: how a map's several mapped arguments combine: item by item (equal lengths) or every pair
COMBINES = ("zip", "product")
ON_EMPTY = ("skip", "success")
#: the trigger rules a node mapped over a parent's result may not have: they can start it before
#: that parent is done, or only when it did not succeed, so there would be nothing to map over
MAP_REFUSED_RULES = frozenset(
    {
        TriggerRule.ALWAYS,
        TriggerRule.ONE_SUCCESS,
        TriggerRule.ONE_DONE,
        TriggerRule.ONE_FAILED,
        TriggerRule.ALL_FAILED,
        TriggerRule.ALL_SKIPPED,
    }
)
MAP_KEY_FIELD_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
#: a map wider than this inserts its children this many at a time (the next window once half of
#: the inserted ones are done): a 100,000-wide map starts its first child without inserting all
MAP_WINDOW = 10_000


@dataclass(frozen=True)
class MapArg:
    """One mapped keyword argument: each child gets one item of ``source``'s result (a node key)
    or of ``items`` (a literal list) as ``kwarg``."""

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
    (:meth:`DAG.per_item`)."""

    args: tuple[MapArg, ...]
    combine: str | None = None
    map_key: str | None = None
    on_empty: str = "skip"
    max_length: int = DEFAULT_MAX_MAP_LENGTH
    max_active: int | None = None

    def to_spec(self) -> dict[str, Any]:
        """The spec format's ``map`` field."""
        spec: dict[str, Any]
        if len(self.args) == 1:
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
        return spec

    def to_row(self, per_item: str | None) -> dict[str, Any]:
        """The task row's ``map_spec`` (what ``orc_expand_v1`` reads); ``per_item``: the mapped
        node this one maps item by item over."""
        row: dict[str, Any] = {
            "args": [
                {"kwarg": a.kwarg, "from": a.source} if a.source is not None
                else {"kwarg": a.kwarg, "items": list(a.items or ())}
                for a in self.args
            ],
            "combine": self.combine or "zip",
            "on_empty": self.on_empty,
            "max_length": self.max_length,
            "window": MAP_WINDOW,
        }  # fmt: skip
        if self.map_key is not None:
            row["map_key"] = self.map_key
        if self.max_active is not None:
            row["max_active"] = self.max_active
        if per_item is not None:
            row["per_item"] = per_item
        return row


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
    #: Airflow's setup and teardown tasks; a teardown decides its run's state only with ``fails_run``
    setup: bool = False
    teardown: bool = False
    fails_run: bool = False
    #: all_success relaxed: READY once this share of the upstream (a map's children) succeeded
    min_success_ratio: float | None = None
    #: a wait node (``DAG.wait``, ``DAG.approval``): it never runs on a worker, it waits (WAITING)
    wait: WaitSpec | None = None
    #: a sensor (``DAG.sensor``): its check task runs until it returns something truthy
    sensor: SensorSpec | None = None

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
        for flag in ("branch", "short_circuit", "setup", "teardown", "fails_run"):
            if getattr(self, flag):
                spec[flag] = True
        if self.min_success_ratio is not None:
            spec["min_success_ratio"] = self.min_success_ratio
        if self.wait is not None:
            spec["wait"] = self.wait.to_spec()
        if self.sensor is not None:
            spec["sensor"] = self.sensor.to_spec()
        return spec


class DAG:
    """A named graph of :class:`Node` objects for one tenant.

    ``priority`` is the default priority class of the nodes; ``params`` are free JSON
    parameters stored with the run; ``max_active_tasks`` bounds the tasks of one run QUEUED or
    RUNNING at once (admission holds the rest READY). ``deadline`` is the number of seconds after
    the run's logical date (or, without one, after its submit) by which the run must be final;
    a miss, of the run's deadline or of a node's, is recorded once in the ledger and alerted,
    and with ``on_deadline="cancel"`` the reconciler also cancels the run.
    """

    def __init__(
        self,
        name: str,
        *,
        tenant: str = "default",
        priority: Priority | str = Priority.DEFAULT,
        params: Mapping[str, Any] | None = None,
        max_active_tasks: int | None = None,
        deadline: float | None = None,
        on_deadline: OnDeadline | str = OnDeadline.ALERT,
    ) -> None:
        self.name = name
        self.tenant = tenant
        self.max_active_tasks = max_active_tasks
        self.deadline = deadline
        self.priority = _enum(Priority, priority, "priority", dag=_label(name))
        self.on_deadline: OnDeadline = _enum(OnDeadline, on_deadline, "on_deadline", dag=_label(name))
        if params is not None and not isinstance(params, Mapping):
            raise ValidationError(f"params must be a mapping, not {type(params).__name__}", dag=_label(name))
        self.params: dict[str, Any] = dict(params or {})
        self.nodes: dict[str, Node] = {}

    def task(
        self,
        key: str,
        task: Any,
        *,
        upstream: Iterable[Node | str] = (),
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        trigger_rule: TriggerRule | str | None = None,
        max_attempts: int = 1,
        backoff: Backoff | Mapping[str, Any] | None = None,
        soft_time_limit: float | None = None,
        time_limit: float | None = None,
        priority: Priority | str | None = None,
        queue: str | None = None,
        retry_on: Iterable[str | type[BaseException]] = (),
        no_retry_on: Iterable[str | type[BaseException]] = (),
        pool: str | None = None,
        pool_slots: int = 1,
        rate_limit: str | None = None,
        resources: Iterable[str] = (),
        deadline: float | None = None,
        branch: bool = False,
        short_circuit: bool = False,
        setup: bool = False,
        teardown: bool = False,
        fails_run: bool = False,
        min_success_ratio: float | None = None,
        mapping: MapSpec | None = None,
        wait: WaitSpec | None = None,
        sensor: SensorSpec | None = None,
    ) -> Node:
        """Add a node and return it (pass it in another node's ``upstream``).

        ``task`` is a Celery signature (``extract.s(day=...)``), a Celery task object or a
        registered task name. Arguments of a signature are merged with ``args``/``kwargs``;
        of its options (``sig.set(...)``), ``queue``, ``priority`` (a priority class: ``"high"``,
        ``"default"``, ``"low"``), ``soft_time_limit`` and ``time_limit`` become the node's (a
        keyword of this method may repeat one, not contradict it), and the others are refused
        or ignored as :data:`SIGNATURE_OPTIONS` says.
        ``pool`` (with ``pool_slots``) and ``rate_limit`` name a pool and a rate limit that
        must exist when the DAG is submitted (``orchestrator pool set``, ``limit set``).
        ``resources`` names what the task uses (``["stripe", "erp:{tenant}"]``; ``{tenant}``
        becomes the run's tenant): a resource's circuit breaker (``orchestrator breaker set``)
        counts the task's outcomes and, while open, holds it READY at admission.
        ``deadline`` is the number of seconds after the run's logical date (or its submit) by
        which the task must be done (in a terminal state).

        ``trigger_rule`` is one of Airflow's 13 rules (:class:`TriggerRule`; by default
        ``all_success``, and ``all_done_setup_success`` for a teardown). ``branch=True``: the
        task returns the key of the direct child to follow, or a list of them, and the other
        children are SKIPPED (``branch_not_taken``) unless a followed child reaches them.
        ``short_circuit=True``: a falsy result (``None``, ``False``, ``0``, ``""``, ``[]``,
        ``{}``) skips every task downstream. ``setup=True`` / ``teardown=True`` are Airflow's
        setup and teardown tasks: a teardown runs once its upstream is done if a setup upstream
        of it succeeded, whatever the tasks between did, and its failure fails the run only
        with ``fails_run=True``. ``min_success_ratio`` (with ``all_success``) lets the task run
        once that share of its upstream, a map's children counted one by one, succeeded.
        ``mapping`` is :meth:`map`'s, ``wait`` :meth:`wait`'s and ``sensor`` :meth:`sensor`'s.

        Raises :class:`ValidationError` for a duplicate key or a malformed option; the rest
        of the checks run in :meth:`validate`.
        """
        if not isinstance(key, str):
            raise ValidationError(f"node key must be a string, not {type(key).__name__}", dag=_label(self.name))
        if key in self.nodes:
            raise ValidationError("duplicate node key", dag=self.name, node=key)
        if args is not None and not isinstance(args, (list, tuple)):
            raise ValidationError(f"args must be a list, not {type(args).__name__}", dag=self.name, node=key)
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise ValidationError(f"kwargs must be a mapping, not {type(kwargs).__name__}", dag=self.name, node=key)
        if isinstance(upstream, (str, bytes, Mapping)) or not isinstance(upstream, Iterable):
            raise ValidationError("upstream must be a list of nodes or node keys", dag=self.name, node=key)
        upstream = list(upstream)
        for parent in upstream:
            if not isinstance(parent, (Node, str)):
                raise ValidationError(
                    f"upstream holds a {type(parent).__name__}: list nodes or node keys", dag=self.name, node=key
                )
        name, sig_args, sig_kwargs, sig_options = _task_parts(task, self.name, key)
        if sig_options:
            given: dict[str, Any] = {
                "queue": queue,
                "priority": priority,
                "soft_time_limit": soft_time_limit,
                "time_limit": time_limit,
            }
            for option, value in sig_options.items():
                if given[option] is not None and given[option] != value:
                    raise ValidationError(
                        f"{option} is set twice: {short(value)} on the signature, {short(given[option])} as"
                        " the keyword; keep one",
                        dag=self.name,
                        node=key,
                    )
                given[option] = value
            queue, priority = given["queue"], given["priority"]
            soft_time_limit, time_limit = given["soft_time_limit"], given["time_limit"]
        node = Node(
            key=key,
            task=name,
            args=tuple(sig_args) + tuple(args or ()),
            kwargs={**sig_kwargs, **(kwargs or {})},
            upstream=tuple(u.key if isinstance(u, Node) else u for u in upstream),
            trigger_rule=_enum(
                TriggerRule,
                trigger_rule if trigger_rule is not None else "all_done_setup_success" if teardown else "all_success",
                "trigger_rule",
                self.name,
                key,
            ),
            max_attempts=max_attempts,
            backoff=_backoff(backoff, self.name, key),
            soft_time_limit=soft_time_limit,
            time_limit=time_limit,
            priority=None if priority is None else _enum(Priority, priority, "priority", self.name, key),
            queue=queue,
            retry_on=_exception_names(retry_on, "retry_on", self.name, key),
            no_retry_on=_exception_names(no_retry_on, "no_retry_on", self.name, key),
            pool=pool,
            pool_slots=pool_slots,
            rate_limit=rate_limit,
            resources=_resources(resources, self.name, key),
            deadline=deadline,
            map=mapping,
            branch=branch,
            short_circuit=short_circuit,
            setup=setup,
            teardown=teardown,
            fails_run=fails_run,
            min_success_ratio=min_success_ratio,
            wait=wait,
            sensor=sensor,
        )
        self.nodes[key] = node
        return node

    def wait(
        self,
        key: str,
        *,
        event: str | None = None,
        match: Mapping[str, Any] | None = None,
        until: Any = None,
        delay: float | None = None,
        tz: str | None = None,
        timeout: float | None = None,
        on_timeout: str = "fail",
        lookback: float | None = None,
        upstream: Iterable[Node | str] = (),
        trigger_rule: TriggerRule | str | None = None,
        deadline: float | None = None,
    ) -> Node:
        """Add a wait node: it runs on no worker and holds no slot while it waits (``WAITING``).

        ``event="order.paid", match={"order_id": 42}``: it waits for an event of its run's tenant
        (:func:`orchestrator.emit`) or a signal to its run (``run.signal``) with that key whose
        payload contains ``match`` (JSON containment: data, never code); its result is the
        payload. An event emitted up to ``lookback`` seconds (default an hour) before the wait
        began counts too. ``until`` (a datetime or an ISO 8601 instant; or a wall time
        ``"09:30"`` in ``tz``, the next one after the wait begins) or ``delay`` (seconds): it
        waits for that instant; its result is ``None``. ``timeout`` (seconds) ends the wait
        FAILED with ``WaitTimeout``, or SKIPPED with ``on_timeout="skip"``. It begins when its
        ``trigger_rule`` says (by default all its ``upstream`` succeeded), and its deadline and
        instant are absolute from then, whatever restarts. Raises :class:`ValidationError`."""
        spec = WaitSpec.make(
            event=event, match=match, until=until, delay=delay, tz=tz, timeout=timeout, on_timeout=on_timeout,
            lookback=lookback, where=(_label(self.name), key if isinstance(key, str) else None),
        )  # fmt: skip
        return self.task(key, WAIT_TASK, upstream=upstream, trigger_rule=trigger_rule, deadline=deadline, wait=spec)

    def approval(
        self,
        key: str,
        *,
        timeout: float | None = None,
        on_timeout: str = "fail",
        upstream: Iterable[Node | str] = (),
        trigger_rule: TriggerRule | str | None = None,
        deadline: float | None = None,
    ) -> Node:
        """Add an approval node: it waits (``WAITING``) until a person answers with ``orchestrator
        approve RUN KEY`` (it SUCCEEDS, its result ``{"approved": true, "by": ..., "comment":
        ...}``), ``orchestrator reject RUN KEY`` (it FAILS, ``Rejected: ...``), the run page or
        :meth:`Orchestrator.approve`; who answered is in the ledger. ``timeout`` as :meth:`wait`."""
        spec = WaitSpec.make(
            timeout=timeout, on_timeout=on_timeout, approval=True,
            where=(_label(self.name), key if isinstance(key, str) else None),
        )  # fmt: skip
        return self.task(key, WAIT_TASK, upstream=upstream, trigger_rule=trigger_rule, deadline=deadline, wait=spec)

    def sensor(
        self,
        key: str,
        check: Any,
        *,
        every: float,
        timeout: float | None = None,
        backoff: float = 1.0,
        max_every: float | None = None,
        on_timeout: str = "fail",
        **options: Any,
    ) -> Node:
        """Add a sensor: the task ``check`` runs, and while it returns something falsy it runs
        again ``every`` seconds later (times ``backoff`` after each "not yet", at most
        ``max_every``), waiting in between as a row that holds no worker slot (Airflow's
        reschedule mode), until it returns something truthy (the sensor's result) or
        ``timeout`` seconds after its first check (``WaitTimeout``, or SKIPPED with
        ``on_timeout="skip"``). Its retries on an exception are the task's own
        (``max_attempts``). The other ``options`` are :meth:`task`'s."""
        spec = SensorSpec.make(
            every=every, timeout=timeout, backoff=backoff, max_every=max_every, on_timeout=on_timeout,
            where=(_label(self.name), key if isinstance(key, str) else None),
        )  # fmt: skip
        return self.task(key, check, sensor=spec, **options)

    def map(
        self,
        key: str,
        task: Any,
        *,
        over: Node | str | Sequence[Any] | Mapping[str, Node | str | Sequence[Any]],
        kwarg: str | None = None,
        upstream: Iterable[Node | str] = (),
        combine: str | None = None,
        map_key: str | None = None,
        on_empty: str = "skip",
        max_map_length: int = DEFAULT_MAX_MAP_LENGTH,
        max_active: int | None = None,
        **options: Any,
    ) -> Node:
        """Add a mapped node: one child task per item, keyed ``key[map_key]``.

        ``over`` is a node (or its key) whose result is the list (a JSON list, or an object
        whose values are the items and keys the map keys), or a literal list; each item is
        passed to ``task`` as the keyword ``kwarg``, beside the signature's constant arguments.
        Several mapped arguments: ``over={"path": listing, "size": [256, 512]}`` (no ``kwarg``)
        with ``combine="zip"`` (item by item, equal lengths) or ``"product"`` (every pair).
        Over another mapped node, the map runs item by item: child ``k`` gets the result of
        that node's child ``k`` and starts when it succeeds (a chained map, depth first).
        ``map_key`` names the field of each (object) item that keys its child (default: the
        item's index). ``on_empty``: ``"skip"`` (the node ends SKIPPED, reason ``empty_map``) or
        ``"success"`` (SUCCEEDED with ``[]``). ``max_map_length`` (default 10,000, at most
        100,000) fails the node's parent whose result is longer, with a ``MapError``;
        ``max_active`` bounds its children QUEUED or RUNNING at once.

        A downstream node counts each child as one upstream task for its trigger rule and gets
        ``upstream[key]``: the results of the children that succeeded, in map order. The
        other ``options`` are :meth:`task`'s.
        """
        dag = self.name
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
        spec = MapSpec(
            args=tuple(args),
            combine=combine,
            map_key=map_key,
            on_empty=on_empty,
            max_length=max_map_length,
            max_active=max_active,
        )
        return self.task(key, task, upstream=parents, mapping=spec, **options)

    def per_item(self, node: Node) -> str | None:
        """The mapped node that ``node`` maps item by item over (its one mapped argument comes
        from a mapped node), or ``None``."""
        if node.map is None or len(node.map.args) != 1 or node.map.args[0].source is None:
            return None
        parent = self.nodes.get(node.map.args[0].source)
        return parent.key if parent is not None and parent.map is not None else None

    def lint(self) -> list[str]:
        """Warnings about a DAG that is valid but likely not what was meant (returned with the
        run handle, printed by the CLI): a node that joins the paths of a branch and keeps
        ``all_success`` is SKIPPED whenever one of those paths is not taken."""
        warnings: list[str] = []
        children: dict[str, list[str]] = {}
        for node in self.nodes.values():
            for parent in node.upstream:
                children.setdefault(parent, []).append(node.key)
        for node in self.nodes.values():
            if not node.branch:
                continue
            reached: dict[str, set[str]] = {}
            for child in children.get(node.key, []):
                seen = {child}
                todo = [child]
                while todo:
                    for nxt in children.get(todo.pop(), []):
                        if nxt not in seen:
                            seen.add(nxt)
                            todo.append(nxt)
                for k in seen:
                    reached.setdefault(k, set()).add(child)
            for k in sorted(reached):
                target = self.nodes[k]
                if len(reached[k]) > 1 and target.trigger_rule is TriggerRule.ALL_SUCCESS:
                    warnings.append(
                        f"node {k!r} joins branches of {node.key!r} ({', '.join(sorted(reached[k]))}) with"
                        " trigger_rule all_success: it is SKIPPED whenever one of them is not taken; use"
                        " none_failed_min_one_success"
                    )
        return warnings

    def priority_of(self, node: Node) -> Priority:
        return node.priority or self.priority

    def validate(
        self,
        is_registered: Callable[[str], bool] | None = None,
        limits: SizeLimits = SizeLimits(),
    ) -> None:
        """Check the whole DAG; raise the first problem as a typed :class:`ValidationError`.

        ``is_registered`` tells whether a task name is registered in the Celery app; names
        in Celery's own ``celery.`` namespace are always refused.

        Whatever built the DAG (:meth:`task`, a spec, or :class:`Node` objects put into
        ``nodes`` by hand), the same checks hold: ``nodes`` maps each node's own key to a
        :class:`Node` whose every field has its type and range, upstream keys exist, no cycle.
        """
        dag = self.name
        problem = text_problem(dag, MAX_NAME_CHARS)
        if problem:
            raise ValidationError(f"name: {problem}", dag=_label(dag))
        if not isinstance(self.tenant, str) or not TENANT_RE.fullmatch(self.tenant):
            raise ValidationError(f"tenant {short(self.tenant)} must be 1-64 letters, digits, '_' or '-'", dag=dag)
        if not isinstance(self.priority, Priority):
            raise ValidationError(f"priority must be high, default or low, not {short(self.priority)}", dag=dag)
        if not isinstance(self.params, Mapping):
            raise ValidationError(f"params must be a mapping, not {type(self.params).__name__}", dag=dag)
        if not isinstance(self.nodes, dict):
            raise ValidationError(f"nodes must be a dict of node key to Node, not {type(self.nodes).__name__}", dag=dag)
        for key, node in self.nodes.items():
            label = key if isinstance(key, str) and not text_problem(key, 300) else short(key)
            if not isinstance(node, Node):
                raise ValidationError(
                    f"nodes[{short(key)}] is a {type(node).__name__}, not a Node", dag=dag, node=label
                )
            if not isinstance(key, str) or node.key != key:
                # two entries holding one key would be two tasks of one key in the run
                raise ValidationError(
                    f"nodes[{short(key)}] holds the node keyed {short(node.key)}: a node is stored under its own key",
                    dag=dag,
                    node=label,
                )
        if not self.nodes:
            raise ValidationError("the DAG has no nodes", dag=dag)
        if len(self.nodes) > limits.max_nodes:
            raise ValidationError(
                f"{len(self.nodes)} nodes exceed the limit of {limits.max_nodes} (ORCHESTRATOR_MAX_NODES)",
                dag=dag,
            )
        mat = self.max_active_tasks
        if mat is not None and (isinstance(mat, bool) or not isinstance(mat, int) or not 1 <= mat <= MAX_ACTIVE_TASKS):
            raise ValidationError(
                f"max_active_tasks must be an integer from 1 to {MAX_ACTIVE_TASKS}, not {short(mat)}", dag=dag
            )
        problem = deadline_problem(self.deadline)
        if problem:
            raise ValidationError(problem, dag=dag)
        if not isinstance(self.on_deadline, OnDeadline):
            raise ValidationError(f"on_deadline must be 'alert' or 'cancel', not {short(self.on_deadline)}", dag=dag)
        check_json(self.params, "params", dag=dag)
        if _json_size(self.params) > limits.max_params_bytes:
            raise ValidationError(f"params exceed {limits.max_params_bytes} bytes of JSON", dag=dag)
        known: set[str] = set()  # task names already found valid and registered
        for node in self.nodes.values():
            _validate_node(node, self, is_registered, limits, known)
        if self.on_deadline is OnDeadline.CANCEL and not self.has_deadlines:
            raise ValidationError("on_deadline 'cancel' needs a deadline, on the DAG or on a node", dag=dag)
        find_cycle_or_raise(self)

    @property
    def has_deadlines(self) -> bool:
        """Whether the DAG or any of its nodes sets a deadline."""
        return self.deadline is not None or any(n.deadline is not None for n in self.nodes.values())

    def roots(self) -> list[Node]:
        return [n for n in self.nodes.values() if not n.upstream]

    def to_spec(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "tenant": self.tenant,
            "priority": self.priority.value,
            "params": self.params,
            **({} if self.max_active_tasks is None else {"max_active_tasks": self.max_active_tasks}),
            **({} if self.deadline is None else {"deadline": self.deadline}),
            **({} if self.on_deadline is OnDeadline.ALERT else {"on_deadline": self.on_deadline.value}),
            "nodes": [n.to_spec() for n in self.nodes.values()],
        }

    def with_tenant(self, tenant: str) -> DAG:
        """A copy of this DAG for another tenant."""
        other = DAG(
            self.name,
            tenant=tenant,
            priority=self.priority,
            params=self.params,
            max_active_tasks=self.max_active_tasks,
            deadline=self.deadline,
            on_deadline=self.on_deadline,
        )
        # the nodes as they are (frozen): validate() judges them, whatever they hold
        other.nodes = dict(self.nodes) if isinstance(self.nodes, dict) else self.nodes
        return other


def _validate_node(
    node: Node,
    dag: DAG,
    is_registered: Callable[[str], bool] | None,
    limits: SizeLimits,
    known: set[str] | None = None,
) -> None:
    d, k = dag.name, node.key

    def fail(message: str) -> ValidationError:
        return ValidationError(message, dag=d, node=k)

    if not isinstance(k, str) or not KEY_RE.fullmatch(k):
        label = k if isinstance(k, str) and not text_problem(k, 300) else short(k)
        raise ValidationError(f"node key {short(k)} must be 1-200 letters, digits, '_' or '-'", dag=d, node=label)
    if getattr(node, "wait", None) is not None or node.task == WAIT_TASK:
        _validate_wait(node, fail, d)
    elif known is None or not isinstance(node.task, str) or node.task not in known:
        if not isinstance(node.task, str) or not TASK_NAME_RE.fullmatch(node.task):
            raise fail(f"task {short(node.task)} is not a valid Celery task name")
        if node.task.startswith("celery."):
            raise UnknownTaskError(f"task {node.task!r} is internal to Celery", dag=d, node=k)
        if is_registered is not None and not is_registered(node.task):
            raise UnknownTaskError(
                f"task {node.task!r} is not registered in the Celery app (add its module to ORCHESTRATOR_TASK_MODULES)",
                dag=d,
                node=k,
            )
        if known is not None:
            known.add(node.task)
    if not isinstance(node.args, (tuple, list)):
        raise fail(f"args must be a list, not {type(node.args).__name__}")
    if not isinstance(node.kwargs, Mapping):
        raise fail("kwargs must be a mapping")
    if not all(isinstance(name, str) for name in node.kwargs):
        raise fail("kwargs must have string keys")
    if not isinstance(node.upstream, (tuple, list)):
        raise fail(f"upstream must be a list of node keys, not {type(node.upstream).__name__}")
    for parent in node.upstream:
        if not isinstance(parent, str):
            raise fail(f"upstream holds a {type(parent).__name__}: list node keys")
    if node.args or node.kwargs:  # the common no-argument node needs no JSON walk
        check_json(list(node.args), "args", dag=d, node=k)
        check_json(dict(node.kwargs), "kwargs", dag=d, node=k)
        if _json_size([list(node.args), dict(node.kwargs)]) > limits.max_node_bytes:
            raise fail(f"arguments exceed {limits.max_node_bytes} bytes of JSON")
    seen: set[str] = set()
    for parent in node.upstream:
        if parent in seen:
            raise fail(f"upstream {parent!r} is listed twice")
        seen.add(parent)
        if parent not in dag.nodes:
            raise fail(f"unknown upstream key {parent!r}")
    if not isinstance(node.trigger_rule, TriggerRule):
        raise fail(f"unknown trigger rule {node.trigger_rule!r}")
    if isinstance(node.max_attempts, bool) or not isinstance(node.max_attempts, int):
        raise fail(f"max_attempts must be an integer, not {short(node.max_attempts)}")
    if not 1 <= node.max_attempts <= MAX_ATTEMPTS:
        raise fail(f"max_attempts must be 1 to {MAX_ATTEMPTS}, not {node.max_attempts}")
    b = node.backoff
    if not isinstance(b, Backoff):
        raise fail(f"backoff must be a Backoff, not {type(b).__name__}")
    if not isinstance(b.jitter, Jitter):
        raise fail(f"backoff.jitter must be full, equal or none, not {short(b.jitter)}")
    for name in ("base", "cap"):
        value = getattr(b, name)
        if not _positive(value) or value > MAX_BACKOFF:
            raise fail(f"backoff.{name} must be a number of seconds above 0 and at most {MAX_BACKOFF}")
    if b.cap < b.base:
        raise fail("backoff needs base <= cap")
    for name in ("soft_time_limit", "time_limit"):
        value = getattr(node, name)
        if value is not None and (not _positive(value) or value < MIN_TIME_LIMIT):
            raise fail(f"{name} must be a number of seconds of at least {MIN_TIME_LIMIT:g}, not {short(value)}")
    if node.soft_time_limit is not None and node.time_limit is not None and node.soft_time_limit >= node.time_limit:
        raise fail("soft_time_limit must be below time_limit")
    if node.priority is not None and not isinstance(node.priority, Priority):
        raise fail(f"priority must be high, default or low, not {short(node.priority)}")
    for name in ("retry_on", "no_retry_on"):
        if not isinstance(getattr(node, name), (tuple, list)):
            raise fail(f"{name} must list exception class names, not {short(getattr(node, name))}")
        for item in getattr(node, name):
            if not isinstance(item, str) or not TASK_NAME_RE.fullmatch(item):
                raise fail(f"{name} must list exception class names, not {short(item)}")
    if node.queue is not None and (not isinstance(node.queue, str) or not QUEUE_RE.fullmatch(node.queue)):
        raise fail(f"queue {short(node.queue)} is not a valid queue name")
    for name in ("pool", "rate_limit"):
        value = getattr(node, name)
        if value is not None and (not isinstance(value, str) or not LIMIT_NAME_RE.fullmatch(value)):
            raise fail(f"{name} {short(value)} must be 1-64 letters, digits, '_', '.', ':' or '-'")
    problem = resources_problem(node.resources)
    if problem:
        raise fail(problem)
    if node.resources and node.wait is not None:
        raise fail("resources are for a task that runs on a worker, not a wait node")
    slots = node.pool_slots
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_POOL_SLOTS:
        raise fail(f"pool_slots must be an integer from 1 to {MAX_POOL_SLOTS}, not {short(slots)}")
    if slots != 1 and node.pool is None:
        raise fail("pool_slots needs a pool")
    problem = deadline_problem(node.deadline)
    if problem:
        raise fail(problem)
    for flag in ("branch", "short_circuit", "setup", "teardown", "fails_run"):
        if not isinstance(getattr(node, flag), bool):
            raise fail(f"{flag} must be true or false, not {short(getattr(node, flag))}")
    if node.branch and node.short_circuit:
        raise fail("a node is a branch or a short circuit, not both")
    if node.setup and node.teardown:
        raise fail("a node is a setup or a teardown, not both")
    if node.fails_run and not node.teardown:
        raise fail("fails_run is a teardown's option (every other task's failure fails its run)")
    ratio = node.min_success_ratio
    if ratio is not None:
        if not _positive(ratio) or ratio > 1:
            raise fail(f"min_success_ratio must be a number above 0 and at most 1, not {short(ratio)}")
        if node.trigger_rule is not TriggerRule.ALL_SUCCESS:
            raise fail(f"min_success_ratio relaxes all_success, not {node.trigger_rule.value}")
        if not node.upstream:
            raise fail("min_success_ratio needs upstream tasks")
    if node.map is not None:
        _validate_map(node, dag, limits, fail)
    if node.sensor is not None:
        if not isinstance(node.sensor, SensorSpec):
            raise fail(f"sensor must be a SensorSpec, not {type(node.sensor).__name__}")
        node.sensor.checked((d, k))  # a hand-built one too
        for what in ("map", "branch", "short_circuit"):
            if getattr(node, what):
                raise fail(f"a sensor cannot be a {what.replace('_', ' ')}")


def _validate_wait(node: Node, fail: Callable[[str], ValidationError], dag: str | None = None) -> None:
    """A wait node: the wait task name with a :class:`WaitSpec` (one ``WaitSpec.make`` would
    build, its match within the bounds), nothing a worker would run."""
    if not isinstance(node.wait, WaitSpec) or node.task != WAIT_TASK:
        raise fail(f"{WAIT_TASK!r} is the task of a wait node: build it with DAG.wait or DAG.approval")
    node.wait.checked((dag, node.key))
    if node.args or node.kwargs:
        raise fail("a wait node takes no arguments")
    for what in ("map", "branch", "short_circuit", "setup", "teardown", "sensor", "pool", "rate_limit"):
        if getattr(node, what):
            raise fail(f"a wait node cannot have {what.replace('_', ' ')}")
    if node.wait.match is not None:
        check_json(dict(node.wait.match), "match", dag=None, node=node.key)


def _validate_map(node: Node, dag: DAG, limits: SizeLimits, fail: Callable[[str], ValidationError]) -> None:
    spec = node.map
    if not isinstance(spec, MapSpec):
        raise fail(f"map must be a MapSpec, not {type(spec).__name__}")
    if not isinstance(spec.args, tuple) or not spec.args or not all(isinstance(a, MapArg) for a in spec.args):
        raise fail("map needs at least one mapped argument")
    for what in ("branch", "short_circuit", "setup", "teardown"):
        if getattr(node, what):
            raise fail(f"a mapped node cannot be a {what.replace('_', ' ')}")
    names = [a.kwarg for a in spec.args]
    for name in names:
        if not isinstance(name, str) or not name.isidentifier():
            raise fail(f"mapped keyword {short(name)} is not a Python identifier")
        if name in node.kwargs:
            raise fail(f"mapped keyword {name!r} is also a constant kwarg: keep one")
        if name == UPSTREAM_KWARG:
            raise fail(f"{UPSTREAM_KWARG!r} is reserved for the parents' results")
    if len(set(names)) != len(names):
        raise fail("a mapped keyword is listed twice")
    if len(spec.args) > 1 and spec.combine not in COMBINES:
        raise fail(f"several mapped arguments need combine='zip' or 'product', not {short(spec.combine)}")
    if spec.combine is not None and spec.combine not in COMBINES:
        raise fail(f"combine must be 'zip' or 'product', not {short(spec.combine)}")
    if spec.on_empty not in ON_EMPTY:
        raise fail(f"on_empty must be 'skip' or 'success', not {short(spec.on_empty)}")
    cap = min(MAX_MAP_LENGTH, limits.max_nodes)
    length = spec.max_length
    if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= cap:
        raise fail(f"max_map_length must be an integer from 1 to {cap} (ORCHESTRATOR_MAX_NODES), not {short(length)}")
    active = spec.max_active
    if active is not None and (isinstance(active, bool) or not isinstance(active, int) or active < 1):
        raise fail(f"max_active must be a positive integer, not {short(active)}")
    if spec.map_key is not None and (not isinstance(spec.map_key, str) or not MAP_KEY_FIELD_RE.fullmatch(spec.map_key)):
        raise fail(f"map_key {short(spec.map_key)} must name an item field: 1-64 letters, digits, '_', '.' or '-'")
    if len(node.key) > 150:
        raise fail("a mapped node's key is at most 150 characters (its children's keys add the map key)")
    from_nodes = False
    for arg in spec.args:
        if arg.source is not None:
            from_nodes = True
            if not isinstance(arg.source, str) or arg.source not in dag.nodes:
                raise fail(f"map over unknown node {short(arg.source)}")
            if arg.source not in node.upstream:
                raise fail(f"map over {arg.source!r}, which is not upstream of it")
            if arg.items is not None:
                raise fail(f"mapped argument {arg.kwarg!r} has both a source and items")
        else:
            if not isinstance(arg.items, tuple):
                raise fail(f"mapped argument {arg.kwarg!r} needs a node or a list")
            check_json(list(arg.items), f"map items of {arg.kwarg!r}", dag=dag.name, node=node.key)
            if len(arg.items) > length:
                raise fail(f"{len(arg.items)} items of {arg.kwarg!r} exceed max_map_length {length}")
    if from_nodes and node.trigger_rule in MAP_REFUSED_RULES:
        raise fail(
            f"trigger_rule {node.trigger_rule.value} on a node mapped over a parent's result: it can start it"
            " before that parent succeeded, with nothing to map over"
        )
    if node.min_success_ratio is not None:
        raise fail("min_success_ratio belongs to the node after the map (the join), not to the map")
    over_map = [a.source for a in spec.args if a.source is not None and dag.nodes[a.source].map is not None]
    if over_map:
        if len(spec.args) > 1:
            raise fail(f"a node mapped over the mapped node {over_map[0]!r} maps item by item: one mapped argument")
        if tuple(node.upstream) != (over_map[0],):
            raise fail(
                f"a node mapped item by item over {over_map[0]!r} has it as its only upstream (each child waits"
                " for its own item)"
            )
        if active is not None:
            raise fail("max_active applies to a map over a list; a map item by item follows its source's pace")
        if spec.map_key is not None:
            raise fail("map_key: a map item by item takes the keys of the map it follows")


def deadline_problem(value: Any) -> str | None:
    """Why ``value`` is not an acceptable ``deadline`` (seconds), or ``None`` (``None`` is no deadline)."""
    if value is None:
        return None
    if not _positive(value) or value > MAX_DEADLINE:
        return f"deadline must be a number of seconds above 0 and at most {MAX_DEADLINE}, not {short(value)}"
    return None


def _resources(values: Any, dag: str, key: str) -> tuple[str, ...]:
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise ValidationError("resources must be a list of resource names", dag=dag, node=key)
    names = tuple(values)
    problem = resources_problem(names)
    if problem:
        raise ValidationError(problem, dag=dag, node=key)
    return tuple(dict.fromkeys(names))


def resources_problem(names: Any) -> str | None:
    """Why ``names`` is no list of resource names (``{tenant}`` allowed), or ``None``."""
    if not isinstance(names, (tuple, list)):
        return f"resources must be a list of resource names, not {short(names)}"
    if len(names) > MAX_RESOURCES:
        return f"a task may use at most {MAX_RESOURCES} resources, not {len(names)}"
    for name in names:
        if not isinstance(name, str) or len(name) > 64 or not RESOURCE_RE.fullmatch(name):
            return (
                f"resource {short(name)} must be 1-64 letters, digits, '_', '.', ':' or '-'"
                " (and {tenant} for the run's tenant)"
            )
    return None


def expand_resources(
    names: Sequence[str], tenant: str, *, dag: str | None = None, node: str | None = None
) -> list[str] | None:
    """A node's resources for a run of ``tenant`` (``{tenant}`` replaced), or ``None`` for none;
    raises :class:`ValidationError` when an expanded name is not a valid breaker name."""
    if not names:
        return None
    out = []
    for name in names:
        full = name.replace("{tenant}", tenant)
        if not LIMIT_NAME_RE.fullmatch(full):
            raise ValidationError(
                f"resource {name!r} for tenant {tenant!r} is {full!r}: a resource must be 1-64 letters,"
                " digits, '_', '.', ':' or '-'",
                dag=dag,
                node=node,
            )
        out.append(full)
    return list(dict.fromkeys(out))


def _exception_names(values: Any, what: str, dag: str, key: str) -> tuple[str, ...]:
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


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages about bad input."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - the type is evidence enough
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _label(value: Any) -> str:
    """A DAG name fit for an error message, whatever it is."""
    return value if isinstance(value, str) and not text_problem(value, MAX_NAME_CHARS) else short(value)


def text_problem(value: Any, max_chars: int) -> str | None:
    """Why ``value`` is not an acceptable free-text name (DAG name, idempotency key, logical
    date), or ``None``: a non-empty string of at most ``max_chars`` characters, no NUL, no
    control characters, no lone surrogates."""
    if not isinstance(value, str):
        return f"must be a string, not {type(value).__name__}"
    if not value:
        return "must not be empty"
    if len(value) > max_chars:
        return f"is {len(value)} characters, over {max_chars}"
    for ch in value:
        if ch < " " or ch == "\x7f":
            return f"holds the control character {ch!r}"
        if "\ud800" <= ch <= "\udfff":
            return "holds a lone surrogate (not valid Unicode)"
    return None


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def find_cycle_or_raise(dag: DAG) -> None:
    """Raise :class:`CycleError` naming one cycle, if the graph has any (iterative DFS)."""
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(dag.nodes, white)
    for start in dag.nodes:
        if colour[start] != white:
            continue
        stack: list[tuple[str, int]] = [(start, 0)]
        path: list[str] = [start]
        colour[start] = grey
        while stack:
            key, i = stack[-1]
            ups = dag.nodes[key].upstream
            if i < len(ups):
                stack[-1] = (key, i + 1)
                nxt = ups[i]
                if colour[nxt] == grey:
                    cycle = [*path[path.index(nxt) :], nxt]
                    # edges point child -> parent here; report them in run order
                    cycle.reverse()
                    raise CycleError(cycle, dag=dag.name)
                if colour[nxt] == white:
                    colour[nxt] = grey
                    stack.append((nxt, 0))
                    path.append(nxt)
            else:
                colour[key] = black
                stack.pop()
                path.pop()


def check_json(value: Any, what: str, *, dag: str | None = None, node: str | None = None) -> None:
    """Raise :class:`ValidationError` unless ``value`` is plain JSON.

    Plain JSON is None, bool, int, finite float, str, lists/tuples of it and dicts with
    string keys. NaN/Infinity, sets, bytes and other objects are refused.
    """
    stack: list[tuple[Any, str, int]] = [(value, what, 0)]
    while stack:
        item, where, depth = stack.pop()
        if item is None or isinstance(item, bool):
            continue
        if isinstance(item, int):
            if not -MAX_JSON_INT - 1 <= item <= MAX_JSON_INT:
                raise ValidationError(f"{where} holds an integer outside 64 bits", dag=dag, node=node)
            continue
        if isinstance(item, str):
            _check_string(item, where, dag, node)
            continue
        if isinstance(item, float):
            if not math.isfinite(item):
                raise ValidationError(f"{where} holds {item!r}, which is not JSON", dag=dag, node=node)
            continue
        if isinstance(item, (list, tuple, dict)) and depth >= MAX_JSON_DEPTH:
            raise ValidationError(f"{where} is nested more than {MAX_JSON_DEPTH} deep", dag=dag, node=node)
        if isinstance(item, (list, tuple)):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(item))
            continue
        if isinstance(item, dict):
            for k, v in item.items():
                if not isinstance(k, str):
                    raise ValidationError(f"{where} has the non-string key {short(k)}", dag=dag, node=node)
                _check_string(k, f"{where} key", dag, node)
                stack.append((v, f"{where}.{k}", depth + 1))
            continue
        raise ValidationError(f"{where} holds a {type(item).__name__}, which is not JSON", dag=dag, node=node)


def _check_string(value: str, where: str, dag: str | None, node: str | None) -> None:
    # Postgres stores neither NUL nor a lone surrogate in JSON text
    if "\x00" in value:
        raise ValidationError(f"{where} holds a NUL character", dag=dag, node=node)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError(f"{where} holds a lone surrogate (not valid Unicode)", dag=dag, node=node) from None


def _json_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")))


def _enum(cls: Any, value: Any, what: str, dag: str | None = None, node: str | None = None) -> Any:
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(m.value for m in cls)
        raise ValidationError(f"unknown {what} {value!r} (one of: {choices})", dag=dag, node=node) from None


def _backoff(value: Backoff | Mapping[str, Any] | None, dag: str, key: str) -> Backoff:
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
        jitter=_enum(Jitter, value.get("jitter", "full"), "jitter", dag, key),
    )


#: What :meth:`DAG.task` does with each option of a Celery signature (``sig.set(...)``);
#: any other option is refused too. The orchestrator publishes every message itself, one
#: per attempt, with its own task id, headers and routing, and keeps every delay in the
#: database: an option that would change that would break the promise, and is refused with
#: a :class:`ValidationError` naming the node and the option; one that only tunes how Celery
#: would have published or stored a result changes nothing here, and is ignored.
SIGNATURE_OPTIONS: dict[str, str] = {
    # honoured: they become the node's fields of the same name
    "queue": "honoured",
    "priority": "honoured",
    "soft_time_limit": "honoured",
    "time_limit": "honoured",
    # ignored, harmless: no result backend is read, and publishing (retries included) is the orchestrator's
    "ignore_result": "ignored",
    "add_to_parent": "ignored",
    "retry": "ignored",
    "retry_policy": "ignored",
    "compression": "ignored",
    "serializer": "ignored",  # "json" only: every message is JSON
    # refused
    "countdown": "the orchestrator never leaves a delay (an ETA) in the broker: delays live in the database",
    "eta": "the orchestrator never leaves a delay (an ETA) in the broker: delays live in the database",
    "expires": "a message that expires is dropped and its task would never finish",
    "link": "a callback runs outside the DAG: make it a downstream node",
    "link_error": "an error callback runs outside the DAG: make it a downstream node (trigger_rule 'one_failed')",
    "task_id": "the orchestrator sets each attempt's task id",
    "headers": "the orchestrator sets the message headers",
    "shadow": "the task is shown under its real name",
    "exchange": "routing is by queue: set queue",
    "routing_key": "routing is by queue: set queue",
    "exchange_type": "routing is by queue: set queue",
    "chain": "a chain is not one node: make each part a node and link them with upstream",
    "chord": "a chord is not one node: make each part a node and link them with upstream",
    "group_id": "a group is not one node: make each part a node",
    "group_index": "a group is not one node: make each part a node",
    "parent_id": "the orchestrator publishes each attempt itself",
    "root_id": "the orchestrator publishes each attempt itself",
}


def _task_parts(task: Any, dag: str, key: str) -> tuple[str, Sequence[Any], Mapping[str, Any], dict[str, Any]]:
    """Split a signature, task object or name into (name, args, kwargs, node options) without
    importing Celery; the options are the signature's honoured ones (:data:`SIGNATURE_OPTIONS`)."""
    if isinstance(task, str):
        return task, (), {}, {}
    if isinstance(task, Mapping) and "task" in task:  # a celery Signature is a dict
        kind = task.get("subtask_type")
        if kind is not None:
            raise ValidationError(
                f"a Celery {kind} is not one task: make each of its parts a node and link them with upstream",
                dag=dag,
                node=key,
            )
        options = _signature_options(task.get("options"), dag, key)
        return str(task["task"]), tuple(task.get("args") or ()), dict(task.get("kwargs") or {}), options
    name = getattr(task, "name", None)
    if isinstance(name, str):
        return name, (), {}, {}
    raise ValidationError(
        f"task must be a Celery signature, task or task name, not {type(task).__name__}",
        dag=dag,
        node=key,
    )


def _signature_options(options: Any, dag: str, key: str) -> dict[str, Any]:
    """The node fields a signature's ``options`` set; raise :class:`ValidationError` for an
    option that is refused (:data:`SIGNATURE_OPTIONS`) or unknown."""
    if not options:
        return {}
    if not isinstance(options, Mapping):
        raise ValidationError(f"signature options must be a mapping, not {type(options).__name__}", dag=dag, node=key)
    found: dict[str, Any] = {}
    for option, value in options.items():
        what = SIGNATURE_OPTIONS.get(option) if isinstance(option, str) else None
        if what == "honoured":
            if option == "priority":
                if not isinstance(value, (str, Priority)):
                    raise ValidationError(
                        f"signature option priority={short(value)}: give a priority class ('high', 'default'"
                        " or 'low'); a number means opposite things on Redis and RabbitMQ",
                        dag=dag,
                        node=key,
                    )
                value = _enum(Priority, value, "signature option priority", dag, key)
            found[option] = value
        elif what == "ignored":
            if option == "serializer" and value not in (None, "json"):
                raise ValidationError(
                    f"signature option serializer={short(value)} is refused: every message is JSON", dag=dag, node=key
                )
        elif what is not None:
            raise ValidationError(f"signature option {option!r} is refused: {what}", dag=dag, node=key)
        else:
            raise ValidationError(
                f"signature option {short(option)} is refused: the orchestrator does not honour it"
                " (honoured: queue, priority, soft_time_limit, time_limit)",
                dag=dag,
                node=key,
            )
    return found


NODE_FIELDS = {
    "key",
    "task",
    "args",
    "kwargs",
    "retry_on",
    "no_retry_on",
    "upstream",
    "trigger_rule",
    "max_attempts",
    "backoff",
    "soft_time_limit",
    "time_limit",
    "priority",
    "queue",
    "pool",
    "pool_slots",
    "rate_limit",
    "resources",
    "deadline",
    "map",
    "branch",
    "short_circuit",
    "setup",
    "teardown",
    "fails_run",
    "min_success_ratio",
    "wait",
    "sensor",
}
MAP_FIELDS = {"over", "kwarg", "combine", "map_key", "on_empty", "max_length", "max_active"}
DAG_FIELDS = {"name", "tenant", "priority", "params", "max_active_tasks", "deadline", "on_deadline", "nodes"}


def dag_from_spec(spec: Any) -> DAG:
    """Build a :class:`DAG` from a parsed spec; raise :class:`SpecError` on a wrong shape.

    Types are strict: a field holds its own type or is absent (``args: {}`` or
    ``upstream: false`` are refused, never read as empty); ``null`` means absent only where
    the field is optional. The values then go through :meth:`DAG.task` and
    :meth:`DAG.validate`, exactly as from the Python API."""
    if not isinstance(spec, Mapping):
        raise SpecError("a DAG spec must be a mapping with 'name' and 'nodes'")
    unknown = set(spec) - DAG_FIELDS
    if unknown:
        raise SpecError(f"unknown top-level field(s) {sorted(map(str, unknown))}")
    name = spec.get("name")
    problem = text_problem(name, MAX_NAME_CHARS)
    if problem or not isinstance(name, str):
        raise SpecError(f"'name' {problem}")
    params = spec.get("params", {})
    if not isinstance(params, Mapping):
        raise SpecError("'params' must be a mapping", dag=name)
    for field_name in ("tenant", "priority"):
        if field_name in spec and not isinstance(spec[field_name], str):
            raise SpecError(f"'{field_name}' must be a string", dag=name)
    mat = spec.get("max_active_tasks")
    if mat is not None and (isinstance(mat, bool) or not isinstance(mat, int)):
        raise SpecError(f"'max_active_tasks' must be an integer, not {short(mat)}", dag=name)
    deadline = spec.get("deadline")
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))):
        raise SpecError(f"'deadline' must be a number of seconds, not {short(deadline)}", dag=name)
    on_deadline = spec.get("on_deadline")
    if on_deadline is not None and not isinstance(on_deadline, str):
        raise SpecError(f"'on_deadline' must be 'alert' or 'cancel', not {short(on_deadline)}", dag=name)
    dag = DAG(
        name,
        tenant=spec.get("tenant", "default"),
        priority=spec.get("priority", "default"),
        params=params,
        max_active_tasks=mat,
        deadline=deadline,
        on_deadline=OnDeadline.ALERT if on_deadline is None else on_deadline,
    )
    nodes = spec.get("nodes")
    if not isinstance(nodes, list):
        raise SpecError("'nodes' must be a list", dag=name)
    for i, raw in enumerate(nodes):
        if not isinstance(raw, Mapping):
            raise SpecError(f"nodes[{i}] must be a mapping", dag=name)
        key = raw.get("key")
        if not isinstance(key, str):
            raise SpecError(f"nodes[{i}] needs a string 'key'", dag=name)
        bad = set(raw) - NODE_FIELDS
        if bad:
            raise SpecError(f"unknown field(s) {sorted(map(str, bad))}", dag=name, node=key)
        if "wait" in raw:
            if raw.get("task", WAIT_TASK) != WAIT_TASK:
                raise SpecError("a wait node has no 'task' (it runs on no worker)", dag=name, node=key)
            raw = {**raw, "task": WAIT_TASK}
        if "task" not in raw:
            raise SpecError("missing 'task'", dag=name, node=key)
        for field_name, types, what in _SPEC_TYPES:
            if field_name in raw and not (
                isinstance(raw[field_name], types) and not _bool_as_number(raw[field_name], types)
            ):
                raise SpecError(f"'{field_name}' must be {what}, not {short(raw[field_name])}", dag=name, node=key)
        upstream = raw.get("upstream", [])
        if not all(isinstance(u, str) for u in upstream):
            raise SpecError("'upstream' must be a list of node keys", dag=name, node=key)
        options: dict[str, Any] = {
            flag: raw[flag]
            for flag in ("branch", "short_circuit", "setup", "teardown", "fails_run", "min_success_ratio")
            if flag in raw
        }
        if "wait" in raw:
            options["wait"] = wait_from_spec(raw["wait"], (name, key))
        if "sensor" in raw:
            options["sensor"] = sensor_from_spec(raw["sensor"], (name, key))
        if "map" in raw:
            mapping = options["mapping"] = _map_from_spec(raw["map"], name, key)
            upstream = [*upstream, *(a.source for a in mapping.args if a.source and a.source not in upstream)]
        dag.task(
            key,
            raw["task"],
            upstream=upstream,
            args=raw.get("args", []),
            kwargs=raw.get("kwargs", {}),
            trigger_rule=raw.get("trigger_rule"),
            max_attempts=raw.get("max_attempts", 1),
            backoff=raw.get("backoff"),
            soft_time_limit=raw.get("soft_time_limit"),
            time_limit=raw.get("time_limit"),
            priority=raw.get("priority"),
            queue=raw.get("queue"),
            retry_on=_name_list(raw.get("retry_on"), "retry_on", name, key),
            no_retry_on=_name_list(raw.get("no_retry_on"), "no_retry_on", name, key),
            pool=raw.get("pool"),
            pool_slots=raw.get("pool_slots", 1),
            rate_limit=raw.get("rate_limit"),
            resources=raw.get("resources") or (),
            deadline=raw.get("deadline"),
            **options,
        )
    return dag


def _map_from_spec(raw: Any, dag: str, key: str) -> MapSpec:
    """A node's ``map`` field: ``{"over": <node key> | [items] | {kwarg: <node key> | [items]},
    "kwarg": ..., "combine", "map_key", "on_empty", "max_length", "max_active"}``."""
    if not isinstance(raw, Mapping):
        raise SpecError("'map' must be a mapping with 'over' (and 'kwarg')", dag=dag, node=key)
    bad = set(raw) - MAP_FIELDS
    if bad:
        raise SpecError(f"unknown field(s) of 'map' {sorted(map(str, bad))}", dag=dag, node=key)
    over = raw.get("over")
    kwarg = raw.get("kwarg")
    if isinstance(over, Mapping):
        if kwarg is not None:
            raise SpecError("'map': with 'over' a mapping, its keys are the keywords; drop 'kwarg'", dag=dag, node=key)
        pairs = list(over.items())
    elif isinstance(over, (str, list)):
        if not isinstance(kwarg, str):
            raise SpecError("'map' needs 'kwarg': the keyword each item is passed as", dag=dag, node=key)
        pairs = [(kwarg, over)]
    else:
        raise SpecError(f"'map.over' must be a node key, a list or a mapping, not {short(over)}", dag=dag, node=key)
    args = []
    for name, source in pairs:
        if isinstance(source, str):
            args.append(MapArg(kwarg=name, source=source))
        elif isinstance(source, list):
            args.append(MapArg(kwarg=name, items=tuple(source)))
        else:
            raise SpecError(
                f"'map.over' of {name!r} must be a node key or a list, not {short(source)}", dag=dag, node=key
            )
    for field_name, types in (("combine", (str,)), ("map_key", (str,)), ("on_empty", (str,)),
                              ("max_length", (int,)), ("max_active", (int,))):  # fmt: skip
        value = raw.get(field_name)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            raise SpecError(f"'map.{field_name}' has the wrong type: {short(value)}", dag=dag, node=key)
    return MapSpec(
        args=tuple(args),
        combine=raw.get("combine"),
        map_key=raw.get("map_key"),
        on_empty=raw.get("on_empty", "skip"),
        max_length=raw.get("max_length", DEFAULT_MAX_MAP_LENGTH),
        max_active=raw.get("max_active"),
    )


#: the type of each node field of a spec file (absent means the default; where ``None`` is
#: listed, ``null`` means absent too)
_SPEC_TYPES: tuple[tuple[str, tuple[type, ...], str], ...] = (
    ("task", (str,), "a registered task name"),
    ("args", (list,), "a list"),
    ("kwargs", (dict,), "a mapping"),
    ("upstream", (list,), "a list of node keys"),
    ("max_attempts", (int,), "an integer"),
    ("backoff", (dict, type(None)), "a mapping {base, cap, jitter}"),
    ("soft_time_limit", (int, float, type(None)), "a number of seconds"),
    ("time_limit", (int, float, type(None)), "a number of seconds"),
    ("priority", (str, type(None)), "a priority class"),
    ("queue", (str, type(None)), "a queue name"),
    ("retry_on", (list, type(None)), "a list of exception class names"),
    ("no_retry_on", (list, type(None)), "a list of exception class names"),
    ("pool", (str, type(None)), "a pool name"),
    ("pool_slots", (int,), "an integer"),
    ("rate_limit", (str, type(None)), "a rate limit key"),
    ("resources", (list, type(None)), "a list of resource names"),
    ("deadline", (int, float, type(None)), "a number of seconds"),
    ("trigger_rule", (str, type(None)), "a trigger rule name"),
    ("branch", (bool,), "true or false"),
    ("short_circuit", (bool,), "true or false"),
    ("setup", (bool,), "true or false"),
    ("teardown", (bool,), "true or false"),
    ("fails_run", (bool,), "true or false"),
    ("min_success_ratio", (int, float, type(None)), "a number above 0 and at most 1"),
)


def _bool_as_number(value: Any, types: tuple[type, ...]) -> bool:
    """``True`` is an ``int`` to Python, never a number in a spec."""
    return isinstance(value, bool) and bool not in types


def _name_list(value: Any, what: str, dag: str, key: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SpecError(f"'{what}' must be a list of exception class names", dag=dag, node=key)
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


class _SpecLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing duplicate keys and anchors / aliases (an alias bomb of a
    few hundred bytes expands to gigabytes)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise yaml.constructor.ConstructorError(
                None, None, "anchors and aliases are not accepted in a DAG spec", event.start_mark
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the mapping key {short(key)} is not a string", key_node.start_mark
                ) from None
            if duplicate:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {short(key)}", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def parse_spec(text: str, *, fmt: str) -> Any:
    """Parse spec text as ``json`` or ``yaml``; raise :class:`SpecError` on a syntax error, a
    duplicate key, a YAML anchor or alias, or a document nested too deep to read."""
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(f"the spec is {len(text)} characters, over {MAX_SPEC_BYTES}")
    try:
        if fmt == "json":
            return json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_pairs)
        return yaml.load(text, Loader=_SpecLoader)
    except RecursionError:
        raise SpecError(f"cannot parse {fmt.upper()}: nested too deep") from None
    except (ValueError, yaml.YAMLError) as exc:
        raise SpecError(f"cannot parse {fmt.upper()}: {short(str(exc), 300)}") from None


def read_spec_text(path: str | Path) -> str:
    """The text of a spec file (a DAG's, the schedules' or the triggers'), UTF-8. At most
    :data:`MAX_SPEC_BYTES` are read: an endless file (``/dev/zero``, a FIFO whose writer never
    stops) is refused, never read to its end. Raises :class:`SpecError` (cannot read, too
    large, not UTF-8)."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise SpecError(f"cannot read {p}: {getattr(exc, 'strerror', None) or exc}") from None
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError(f"{p} is over {MAX_SPEC_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"cannot read {p}: not UTF-8 (byte {exc.start}: {exc.reason})") from None


def load_spec(path: str | Path) -> DAG:
    """Read a YAML (``.yaml``/``.yml``) or JSON spec file into a :class:`DAG` (see
    :func:`read_spec_text`)."""
    p = Path(path)
    fmt = "json" if p.suffix.lower() == ".json" else "yaml"
    return dag_from_spec(parse_spec(read_spec_text(p), fmt=fmt))
