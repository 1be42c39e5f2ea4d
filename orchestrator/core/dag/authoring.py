"""Authoring a DAG in code: :class:`DAG` and its builder (``dag.task(key, signature,
upstream=[...])``, ``dag.map``, ``dag.wait``, ``dag.approval``, ``dag.sensor``). The builder turns
what it is given into frozen :class:`Node` values and refuses a malformed option at once;
:meth:`DAG.validate` judges the whole DAG (:mod:`.validation`) before anything is written."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..backoff import Backoff
from ..children import CHILD_TASK, ChildSpec
from ..errors import ValidationError
from ..routing import DEFAULT_TENANT, Priority
from ..states import TriggerRule
from ..waits import WAIT_TASK, SensorSpec, WaitSpec
from .bounds import DEFAULT_MAX_MAP_LENGTH, SizeLimits, label
from .canvas import ATTEMPTS as CANVAS_ATTEMPTS
from .canvas import canvas_name, fill, is_canvas
from .coerce import backoff_value, enum_value, exception_names, map_args, resource_names, transform_name
from .groups import TaskGroup, lend, new_group, touch, with_group_upstream
from .labels import add_label, labels_to_spec
from .model import KWARGS, NO_FILL, MapSpec, Node, OnDeadline
from .passing import result_arg
from .scopes import leaf_deciders
from .signatures import task_parts, with_signature_options
from .validation import validate_dag

#: which tasks decide a run's final state (:class:`DAG`'s ``run_state``)
RUN_STATES = ("all", "leaves")
#: the trigger rules under which a node runs although one of its parents was SKIPPED (a branch
#: not taken), so long as another path reached it (``store/sql/decide.sql``): a skip does not
#: travel through such a node
ABSORBS_SKIPS = frozenset({
    TriggerRule.ALL_DONE, TriggerRule.ONE_SUCCESS, TriggerRule.ONE_DONE, TriggerRule.NONE_FAILED,
    TriggerRule.NONE_FAILED_MIN_ONE_SUCCESS, TriggerRule.ALL_DONE_SETUP_SUCCESS, TriggerRule.ALWAYS,
})  # fmt: skip


class DAG:
    """A named graph of :class:`Node` objects for one tenant.

    ``priority`` is the default priority class of the nodes; ``params`` are free JSON
    parameters stored with the run; ``max_active_tasks`` bounds the tasks of one run QUEUED or
    RUNNING at once (admission holds the rest READY). ``deadline`` is the number of seconds after
    the run's logical date (or, without one, after its submit) by which the run must be final;
    a miss, of the run's deadline or of a node's, is recorded once in the ledger and alerted,
    and with ``on_deadline="cancel"`` the reconciler also cancels the run. ``run_state`` says
    which tasks decide the run's final state: ``"all"`` (the default: the run fails when any task
    that is not a teardown fails or is upstream-failed) or ``"leaves"`` (Airflow's rule: only the
    tasks nothing depends on, a teardown leaf standing for the tasks above it unless it has
    ``fails_run``; a failure absorbed by a leaf that ran anyway leaves the run SUCCEEDED).
    """

    def __init__(
        self,
        name: str,
        *,
        tenant: str = DEFAULT_TENANT,
        priority: Priority | str = Priority.DEFAULT,
        params: Mapping[str, Any] | None = None,
        max_active_tasks: int | None = None,
        deadline: float | None = None,
        on_deadline: OnDeadline | str = OnDeadline.ALERT,
        run_state: str = "all",
    ) -> None:
        self.name = name
        if run_state not in RUN_STATES:
            raise ValidationError(
                f"run_state must be one of {', '.join(RUN_STATES)}, not {run_state!r}", dag=label(name)
            )
        self.run_state = run_state
        self.tenant = tenant
        self.max_active_tasks = max_active_tasks
        self.deadline = deadline
        self.priority = enum_value(Priority, priority, "priority", dag=label(name))
        self.on_deadline: OnDeadline = enum_value(OnDeadline, on_deadline, "on_deadline", dag=label(name))
        if params is not None and not isinstance(params, Mapping):
            raise ValidationError(f"params must be a mapping, not {type(params).__name__}", dag=label(name))
        self.params: dict[str, Any] = dict(params or {})
        self.nodes: dict[str, Node] = {}
        #: the task groups by full name (``DAG.group``), and those open now (innermost last)
        self.groups: dict[str, TaskGroup] = {}
        self._groups: list[TaskGroup] = []
        #: keys are taken as written, a group's prefix included (a spec being loaded)
        self.keys_as_written = False
        #: the edges' labels (:meth:`label`), by ``(parent key, child key)``
        self.labels: dict[tuple[str, str], str] = {}

    def group(self, name: str, *, upstream: Iterable[Node | str | TaskGroup] = (), **defaults: Any) -> TaskGroup:
        """A task group (Airflow's ``TaskGroup``), used as ``with dag.group("section_1") as g:``.
        Each node added inside is keyed ``section_1.<key>`` (nested groups: ``outer.inner.<key>``),
        takes the group's ``defaults`` for the options it leaves at their own defaults (any of
        ``trigger_rule``, ``max_attempts``, ``backoff``, ``pool``, ``pool_slots``, ``queue``,
        ``priority``, ``retry_on``, ``no_retry_on``, ``soft_time_limit``, ``time_limit``,
        ``rate_limit``, ``resources``, ``deadline``; a setup or teardown keeps its own rule), and may
        name another node of the group by its bare key in ``upstream``. ``upstream=`` makes the
        group's roots follow those nodes (``task >> group``); the group in another node's
        ``upstream`` stands for its leaves, a teardown left out (``group >> task``). Raises
        :class:`ValidationError` for a bad name or option."""
        return new_group(self, name, upstream, defaults)

    def label(self, parent: Node | str | TaskGroup, child: Node | str | TaskGroup, text: str) -> None:
        """Write ``text`` on the arrow from ``parent`` to ``child`` (Airflow's ``Label``): the
        run page and ``orchestrator runs graph`` draw it; the run goes as without it. A group
        labels the edges from its leaves (as the parent) or to its roots (as the child); a bare
        key resolves in the open groups. Raises :class:`ValidationError` when there is no such
        edge (add the child first) or ``text`` is not one line of at most 100 characters."""
        add_label(self, parent, child, text)

    def resolve_key(self, key: str) -> str:
        """A key as written inside the open groups: the node of that key in the innermost open
        group that has one, else the key itself."""
        if key in self.nodes:
            return key
        for group in reversed(self._groups):
            if group.key_of(key) in self.nodes:
                return group.key_of(key)
        return key

    def upstream_keys(self, upstream: Iterable[Any], node: str | None) -> list[str]:
        """``upstream`` as node keys: a node's key, a key resolved in the open groups, a group's
        leaves. Raises :class:`ValidationError` for anything else."""
        if isinstance(upstream, (str, bytes, Mapping)) or not isinstance(upstream, Iterable):
            raise ValidationError("upstream must be a list of nodes or node keys", dag=self.name, node=node)
        keys: list[str] = []
        for parent in upstream:
            if isinstance(parent, TaskGroup):
                found = [k for k in parent.leaves() if k not in keys]
                if not found:
                    raise ValidationError(f"group {parent.name!r} has no node yet", dag=self.name, node=node)
                keys += found
            elif isinstance(parent, Node):
                keys.append(parent.key)
            elif isinstance(parent, str):
                keys.append(self.resolve_key(parent))
            else:
                kind = type(parent).__name__
                raise ValidationError(
                    f"upstream holds a {kind}: list nodes, node keys or groups", dag=self.name, node=node
                )
        return keys

    def task(
        self, key: str, task: Any, *, upstream: Iterable[Node | str] = (), args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None, trigger_rule: TriggerRule | str | None = None,
        max_attempts: int = 1, backoff: Backoff | Mapping[str, Any] | None = None,
        soft_time_limit: float | None = None, time_limit: float | None = None, priority: Priority | str | None = None,
        queue: str | None = None, retry_on: Iterable[str | type[BaseException]] = (),
        no_retry_on: Iterable[str | type[BaseException]] = (), pool: str | None = None, pool_slots: int = 1,
        rate_limit: str | None = None, resources: Iterable[str] = (), deadline: float | None = None,
        branch: bool = False, short_circuit: bool = False, setup: bool = False, teardown: bool = False,
        fails_run: bool = False, min_success_ratio: float | None = None, mapping: MapSpec | None = None,
        wait: WaitSpec | None = None, sensor: SensorSpec | None = None, parent_arg: bool = False,
        ignore_downstream_trigger_rules: bool = True, child: ChildSpec | None = None, transactional: bool = False,
    ) -> Node:  # fmt: skip
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

        ``trigger_rule`` is one of Airflow's 13 rules (:class:`TriggerRule`; by default ``all_success``,
        and ``all_done_setup_success`` for a teardown). ``branch=True``: the task returns the key of the
        direct child to follow, or a list of them, and the other children are SKIPPED
        (``branch_not_taken``) unless a followed child reaches them. ``short_circuit=True``: a falsy
        result (``None``, ``False``, ``0``, ``""``, ``[]``, ``{}``) skips every task downstream; with
        ``ignore_downstream_trigger_rules=False`` (Airflow's option) only its direct children, and the
        tasks below them follow their own trigger rules. ``setup=True`` / ``teardown=True`` are
        Airflow's setup and teardown tasks: a teardown runs once its upstream is done if a setup
        upstream of it succeeded, whatever the tasks between did, and its failure fails the run only
        with ``fails_run=True``. ``min_success_ratio`` (with ``all_success``) lets the task run once
        that share of its upstream, a map's children counted one by one, succeeded. ``mapping`` is
        :meth:`map`'s, ``wait`` :meth:`wait`'s and ``sensor`` :meth:`sensor`'s. ``parent_arg=True``: the
        node's single parent's result is its first positional argument, as a Celery chain passes it
        (instead of through a parameter named ``upstream``). ``transactional=True``: its writes commit with its success.

        Raises :class:`ValidationError` for a duplicate key or a malformed option; the rest of the
        checks run in :meth:`validate`."""
        key = self._key_of(key)
        group = self._groups[-1] if self._groups else None
        if group is not None:  # the group's defaults where the call left an option at its own
            (trigger_rule, max_attempts, backoff, soft_time_limit, time_limit, priority, queue, retry_on, no_retry_on,
             pool, pool_slots, rate_limit, resources, deadline) = lend(
                group, setup or teardown, trigger_rule, max_attempts, backoff, soft_time_limit, time_limit, priority,
                queue, retry_on, no_retry_on, pool, pool_slots, rate_limit, resources, deadline)  # fmt: skip
        parents = with_group_upstream(self._groups, self._parents_of_new(key, args, kwargs, upstream))
        name, sig_args, sig_kwargs, sig_options = task_parts(task, self.name, key)
        if parent_arg:
            sig_args = (result_arg(self._single_parent(key, parents)), *sig_args)
        given = {"queue": queue, "priority": priority, "soft_time_limit": soft_time_limit, "time_limit": time_limit}
        fields = with_signature_options(sig_options, given, self.name, key)
        d, rule, level = self.name, trigger_rule, fields["priority"]
        if rule is None:
            rule = "all_done_setup_success" if teardown else "all_success"
        node = Node(
            key=key, task=name, args=tuple(sig_args) + tuple(args or ()), kwargs={**sig_kwargs, **(kwargs or {})},
            upstream=tuple(u.key if isinstance(u, Node) else u for u in parents),
            trigger_rule=enum_value(TriggerRule, rule, "trigger_rule", d, key),
            max_attempts=max_attempts, backoff=backoff_value(backoff, d, key),
            soft_time_limit=fields["soft_time_limit"], time_limit=fields["time_limit"],
            priority=None if level is None else enum_value(Priority, level, "priority", d, key), queue=fields["queue"],
            retry_on=exception_names(retry_on, "retry_on", d, key),
            no_retry_on=exception_names(no_retry_on, "no_retry_on", d, key),
            pool=pool, pool_slots=pool_slots, rate_limit=rate_limit, resources=resource_names(resources, d, key),
            deadline=deadline, map=mapping, branch=branch, short_circuit=short_circuit,
            ignore_downstream_trigger_rules=ignore_downstream_trigger_rules, setup=setup,
            teardown=teardown, fails_run=fails_run, min_success_ratio=min_success_ratio, wait=wait, sensor=sensor,
            child=child, transactional=transactional,
        )  # fmt: skip
        self.nodes[key] = node
        touch(group, node)
        return node

    @classmethod
    def from_canvas(
        cls, canvas: Any, *, name: str | None = None, attempts: int = CANVAS_ATTEMPTS, **options: Any
    ) -> DAG:
        """The DAG a Celery canvas makes (a chain, group, chord or task signature, nested as
        Celery allows), passing results exactly as Celery does: see :mod:`.canvas`. ``name``
        defaults to the canvas's kind and first task (``chain-extract``); each task gets
        ``attempts`` attempts, spent only on a lost worker and ``self.retry()`` as Celery's late
        acks spend them; ``options`` are the constructor's (``tenant``, ``priority``,
        ``params``...). Raises :class:`ValidationError`."""
        if not is_canvas(canvas):
            raise ValidationError(f"a canvas must be a Celery signature, not {type(canvas).__name__}")
        dag = cls(name if name is not None else canvas_name(canvas), **options)
        fill(dag, canvas, attempts)
        return dag

    def _single_parent(self, key: str, parents: Sequence[Node | str]) -> str:
        """The one parent of a node built with ``parent_arg=True``."""
        if len(parents) != 1:
            raise ValidationError(
                f"parent_arg=True passes one parent's result: give exactly one upstream, not {len(parents)}",
                dag=self.name,
                node=key,
            )
        parent = parents[0]
        return parent.key if isinstance(parent, Node) else parent

    def _key_of(self, key: Any) -> Any:
        """A new node's key inside the open groups (``group.key``); a dotted key written by hand is
        refused here, with the reason, not only at submit."""
        if isinstance(key, str) and "." in key and not self.keys_as_written:
            raise ValidationError(
                "a node key holds no '.': it separates a task group's name from the key (add the node inside"
                " `with dag.group(...)`), or prefix the key instead, as section_1__normal",
                dag=label(self.name),
                node=key[:200],
            )
        return self._groups[-1].key_of(key) if self._groups and isinstance(key, str) else key

    def _parents_of_new(self, key: Any, args: Any, kwargs: Any, upstream: Iterable[Any]) -> list[str]:
        """The checks of a :meth:`task` call before its task is read: a string key not in the
        DAG yet, ``args`` a list, ``kwargs`` a mapping and ``upstream`` a list of nodes, node
        keys or groups (returned as keys: :meth:`upstream_keys`)."""
        if not isinstance(key, str):
            raise ValidationError(f"node key must be a string, not {type(key).__name__}", dag=label(self.name))
        if key in self.nodes:
            raise ValidationError("duplicate node key", dag=self.name, node=key)
        if args is not None and not isinstance(args, (list, tuple)):
            raise ValidationError(f"args must be a list, not {type(args).__name__}", dag=self.name, node=key)
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise ValidationError(f"kwargs must be a mapping, not {type(kwargs).__name__}", dag=self.name, node=key)
        return self.upstream_keys(upstream, key)

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
            lookback=lookback, where=(label(self.name), key if isinstance(key, str) else None),
        )  # fmt: skip
        return self.task(key, WAIT_TASK, upstream=upstream, trigger_rule=trigger_rule, deadline=deadline, wait=spec)

    def run_dag(
        self,
        key: str,
        *,
        dag: Any,
        params: Mapping[str, Any] | None = None,
        wait: bool = True,
        on_parent_end: str = "cancel",
        upstream: Iterable[Node | str] = (),
        trigger_rule: TriggerRule | str | None = None,
        max_attempts: int = 1,
        deadline: float | None = None,
    ) -> Node:
        """Add a child-run node: it starts a DAG as a run of its own and waits for it as a row
        (``WAITING``: no worker slot, no message), one child per attempt of the node.

        ``dag`` is a registered DAG (``"etl"``: its latest version when the child starts;
        ``"etl@3"``), a :class:`DAG` (kept as its spec) or a spec mapping; ``params`` are laid over
        its own. The child runs in the parent run's tenant. The node SUCCEEDS with the child's
        results (its leaf tasks' results by key); a child that FAILED or was CANCELLED starts a new
        child on the node's next attempt while ``max_attempts`` allows, else the node FAILS.
        ``wait=False``: the node succeeds once the child is stored, its result ``{"run_id": ...}``.
        ``on_parent_end="cancel"`` cancels a running child when its node stops waiting for it (the
        parent run cancelled, the node cleared or marked); ``"abandon"`` leaves it running. Raises
        :class:`ValidationError`; an unknown registered name is refused at submit."""
        spec = ChildSpec.make(
            dag, params=params, wait=wait, on_parent_end=on_parent_end,
            where=(label(self.name), key if isinstance(key, str) else None),
        )  # fmt: skip
        return self.task(
            key, CHILD_TASK, upstream=upstream, trigger_rule=trigger_rule, deadline=deadline,
            max_attempts=max_attempts, child=spec,
        )  # fmt: skip

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
            where=(label(self.name), key if isinstance(key, str) else None),
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
            where=(label(self.name), key if isinstance(key, str) else None),
        )  # fmt: skip
        return self.task(key, check, sensor=spec, **options)

    def map(
        self,
        key: str,
        task: Any,
        *,
        over: Node | str | Sequence[Any] | Mapping[str, Node | str | Sequence[Any]] | None = None,
        kwarg: str | None = None,
        upstream: Iterable[Node | str] = (),
        combine: str | None = None,
        map_key: str | None = None,
        on_empty: str = "skip",
        max_map_length: int = DEFAULT_MAX_MAP_LENGTH,
        max_active: int | None = None,
        kwargs_from: Node | str | Sequence[Any] | None = None,
        zip_fill: Any = NO_FILL,
        items: str = "values",
        skip_none: bool = False,
        transform: Any = None,
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

        Airflow's mapping forms: ``combine="zip"`` ends with the shortest argument (Airflow's
        ``zip``), ``zip_fill=VALUE`` pads the shorter ones to the longest instead, and
        ``combine="zip_strict"`` fails the node (``MapError``) on unequal lengths.
        ``items="pairs"`` maps a mapping (a dict result) to ``[key, value]`` pairs, its keys still
        naming the children (Airflow maps a dict to pairs); by default its values are the items.
        ``skip_none=True`` drops ``None`` items (Airflow drops a mapped upstream's ``None``
        results); over a mapped node it then waits for all of that node's children and maps their
        results (not item by item). ``kwargs_from`` (instead of ``over``, Airflow's
        ``expand_kwargs``) maps over a node's result or a literal list whose items are each a
        mapping of keyword arguments. ``transform`` (a registered Celery task or its name; its
        function, not a task run) turns each item before the child gets it, in the child's
        attempt (Airflow's ``.map(fn)``): it may raise :class:`~orchestrator.Skip` to skip that
        child, and with ``kwargs_from`` it returns the mapping of keyword arguments.

        A downstream node counts each child as one upstream task for its trigger rule and gets
        ``upstream[key]``: the results of the children that succeeded, in map order. The
        other ``options`` are :meth:`task`'s.
        """
        if kwargs_from is not None:
            if over is not None or kwarg is not None:
                raise ValidationError(
                    "kwargs_from maps keyword arguments by itself: drop over and kwarg", dag=self.name, node=key
                )
            over, kwarg = kwargs_from, KWARGS
        elif over is None:
            raise ValidationError("map needs over (or kwargs_from): what to map over", dag=self.name, node=key)
        args, parents = map_args(over, kwarg, upstream, self.name, key)
        args = tuple(replace(a, source=self.resolve_key(a.source)) if a.source is not None else a for a in args)
        if zip_fill is not NO_FILL and combine is None:
            combine = "zip"  # a fill says how to zip
        spec = MapSpec(
            args=args,
            combine=combine,
            map_key=map_key,
            on_empty=on_empty,
            max_length=max_map_length,
            max_active=max_active,
            zip_fill=zip_fill,
            items=items,
            skip_none=skip_none,
            transform=transform_name(transform, self.name, key),
        )
        return self.task(key, task, upstream=parents, mapping=spec, **options)

    def deciders(self) -> set[str] | None:
        """Under ``run_state="leaves"``, the nodes whose failure fails the run (:func:`.scopes.leaf_deciders`);
        ``None`` under ``"all"``."""
        return leaf_deciders(self.nodes) if self.run_state == "leaves" else None

    def per_item(self, node: Node) -> str | None:
        """The mapped node that ``node`` maps item by item over (its one mapped argument comes
        from a mapped node, and it keeps ``None`` items), or ``None``."""
        if node.map is None or len(node.map.args) != 1 or node.map.args[0].source is None or node.map.skip_none:
            return None
        parent = self.nodes.get(node.map.args[0].source)
        return parent.key if parent is not None and parent.map is not None else None

    def lint(self) -> list[str]:
        """Warnings about a DAG that is valid but likely not what was meant (returned with the
        run handle, printed by the CLI): a node that joins the paths of a branch and keeps
        ``all_success`` is SKIPPED whenever one of those paths is not taken. A path stops at a node
        whose rule absorbs a skipped parent (:data:`ABSORBS_SKIPS`: it runs, so nothing below it is
        skipped by that branch), so a node below such a join is not warned about."""
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
                    here = todo.pop()
                    if here != child and self.nodes[here].trigger_rule in ABSORBS_SKIPS:
                        continue  # it runs when a branch above it is not taken: the skip stops here
                    for nxt in children.get(here, []):
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
        validate_dag(self, is_registered, limits)

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
            **({} if self.run_state == "all" else {"run_state": self.run_state}),
            "nodes": [n.to_spec() for n in self.nodes.values()],
            **({"labels": labels_to_spec(self.labels)} if self.labels else {}),
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
            run_state=self.run_state,
        )
        # the nodes as they are (frozen): validate() judges them, whatever they hold
        other.nodes = dict(self.nodes) if isinstance(self.nodes, dict) else self.nodes
        other.labels = dict(self.labels)
        return other
