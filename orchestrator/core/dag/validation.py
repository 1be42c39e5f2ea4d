"""A DAG judged whole before anything is written (:meth:`DAG.validate`): its own fields, every
node's fields in their types and ranges, each wait, sensor and map, and no cycle. The first
problem is raised as a :class:`ValidationError` naming the DAG and the node; the checks run in a
fixed order, so the same bad DAG always gets the same message.

Validation sits below the builder (:mod:`.authoring` calls it): it reads a DAG through
:class:`DagShape`, whatever built it (:meth:`DAG.task`, a spec, or nodes put in by hand)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ..backoff import Backoff, Jitter
from ..children import CHILD_TASK, ChildSpec
from ..errors import CycleError, UnknownTaskError, ValidationError
from ..routing import Priority
from ..states import TriggerRule
from ..waits import WAIT_TASK, SensorSpec, WaitSpec
from .bounds import (
    COMBINES,
    KEY_RE,
    LIMIT_NAME_RE,
    MAP_ITEMS,
    MAP_KEY_FIELD_RE,
    MAP_REFUSED_RULES,
    MAX_ACTIVE_TASKS,
    MAX_ATTEMPTS,
    MAX_BACKOFF,
    MAX_MAP_LENGTH,
    MAX_NAME_CHARS,
    MAX_POOL_SLOTS,
    MIN_TIME_LIMIT,
    ON_EMPTY,
    QUEUE_RE,
    TASK_NAME_RE,
    TENANT_RE,
    UPSTREAM_KWARG,
    SizeLimits,
    check_json,
    deadline_problem,
    json_size,
    label,
    positive,
    resources_problem,
    short,
    text_problem,
)
from .model import KWARGS, NO_FILL, MapArg, MapSpec, Node, OnDeadline
from .passing import placeholder_problem
from .transactional import check_form as check_transactional

#: builds the error for one node's problem (the DAG and the node named)
Fail = Callable[[str], ValidationError]
#: the flags of a node, each true or false
FLAGS = ("branch", "short_circuit", "setup", "teardown", "fails_run")


class DagShape(Protocol):
    """What validation reads of a :class:`~orchestrator.core.dag.DAG`."""

    @property
    def name(self) -> str: ...
    @property
    def tenant(self) -> str: ...
    @property
    def priority(self) -> Priority: ...
    @property
    def params(self) -> dict[str, Any]: ...
    @property
    def nodes(self) -> dict[str, Node]: ...
    @property
    def max_active_tasks(self) -> int | None: ...
    @property
    def deadline(self) -> float | None: ...
    @property
    def on_deadline(self) -> OnDeadline: ...
    @property
    def has_deadlines(self) -> bool: ...


def validate_dag(dag: DagShape, is_registered: Callable[[str], bool] | None, limits: SizeLimits) -> None:
    """:meth:`DAG.validate`: raise the first problem as a typed :class:`ValidationError`."""
    _check_header(dag)
    _check_entries(dag, limits)
    _check_run_options(dag, limits)
    known: set[str] = set()  # task names already found valid and registered
    for node in dag.nodes.values():
        validate_node(node, dag, is_registered, limits, known)
    if dag.on_deadline is OnDeadline.CANCEL and not dag.has_deadlines:
        raise ValidationError("on_deadline 'cancel' needs a deadline, on the DAG or on a node", dag=dag.name)
    find_cycle_or_raise(dag)


def _check_header(dag: DagShape) -> None:
    """The DAG's name, tenant, priority, params and ``nodes`` in their types."""
    name = dag.name
    problem = text_problem(name, MAX_NAME_CHARS)
    if problem:
        raise ValidationError(f"name: {problem}", dag=label(name))
    if not isinstance(dag.tenant, str) or not TENANT_RE.fullmatch(dag.tenant):
        raise ValidationError(f"tenant {short(dag.tenant)} must be 1-64 letters, digits, '_' or '-'", dag=name)
    if not isinstance(dag.priority, Priority):
        raise ValidationError(f"priority must be high, default or low, not {short(dag.priority)}", dag=name)
    if not isinstance(dag.params, Mapping):
        raise ValidationError(f"params must be a mapping, not {type(dag.params).__name__}", dag=name)
    if not isinstance(dag.nodes, dict):
        raise ValidationError(f"nodes must be a dict of node key to Node, not {type(dag.nodes).__name__}", dag=name)


def _check_entries(dag: DagShape, limits: SizeLimits) -> None:
    """``nodes`` maps each node's own key to a :class:`Node`; at least one, at most the limit."""
    for key, node in dag.nodes.items():
        where = key if isinstance(key, str) and not text_problem(key, 300) else short(key)
        if not isinstance(node, Node):
            raise ValidationError(
                f"nodes[{short(key)}] is a {type(node).__name__}, not a Node", dag=dag.name, node=where
            )
        if not isinstance(key, str) or node.key != key:
            # two entries holding one key would be two tasks of one key in the run
            raise ValidationError(
                f"nodes[{short(key)}] holds the node keyed {short(node.key)}: a node is stored under its own key",
                dag=dag.name,
                node=where,
            )
    if not dag.nodes:
        raise ValidationError("the DAG has no nodes", dag=dag.name)
    if len(dag.nodes) > limits.max_nodes:
        raise ValidationError(
            f"{len(dag.nodes)} nodes exceed the limit of {limits.max_nodes} (ORCHESTRATOR_MAX_NODES)",
            dag=dag.name,
        )


def _check_run_options(dag: DagShape, limits: SizeLimits) -> None:
    """``max_active_tasks``, the deadline and what missing it does, and the params as JSON."""
    name, mat = dag.name, dag.max_active_tasks
    if mat is not None and (isinstance(mat, bool) or not isinstance(mat, int) or not 1 <= mat <= MAX_ACTIVE_TASKS):
        raise ValidationError(
            f"max_active_tasks must be an integer from 1 to {MAX_ACTIVE_TASKS}, not {short(mat)}", dag=name
        )
    problem = deadline_problem(dag.deadline)
    if problem:
        raise ValidationError(problem, dag=name)
    if not isinstance(dag.on_deadline, OnDeadline):
        raise ValidationError(f"on_deadline must be 'alert' or 'cancel', not {short(dag.on_deadline)}", dag=name)
    check_json(dag.params, "params", dag=name)
    if json_size(dag.params) > limits.max_params_bytes:
        raise ValidationError(f"params exceed {limits.max_params_bytes} bytes of JSON", dag=name)


def validate_node(
    node: Node,
    dag: DagShape,
    is_registered: Callable[[str], bool] | None,
    limits: SizeLimits,
    known: set[str] | None = None,
) -> None:
    """One node of ``dag``: every field in its type and range, its options consistent.
    ``known``: task names already found valid and registered (not asked again)."""
    d, k = dag.name, node.key

    def fail(message: str) -> ValidationError:
        return ValidationError(message, dag=d, node=k)

    if not isinstance(k, str) or not KEY_RE.fullmatch(k):
        where = k if isinstance(k, str) and not text_problem(k, 300) else short(k)
        raise ValidationError(
            f"node key {short(k)} must be 1-200 letters, digits, '_' or '-', optionally ending in an index [N]",
            dag=d,
            node=where,
        )
    if "[" in k and getattr(dag.nodes.get(k.split("[", 1)[0]), "map", None) is not None:
        raise fail(f"node key {k!r} would be a child of the mapped node {k.split('[', 1)[0]!r}")
    if getattr(node, "child", None) is not None or node.task == CHILD_TASK:
        _validate_child(node, fail, d)
    elif getattr(node, "wait", None) is not None or node.task == WAIT_TASK:
        _validate_wait(node, fail, d)
    elif known is None or not isinstance(node.task, str) or node.task not in known:
        _check_task_name(node, d, is_registered, known, fail)
    _check_arguments(node, dag, limits, fail)
    if not isinstance(node.trigger_rule, TriggerRule):
        raise fail(f"unknown trigger rule {node.trigger_rule!r}")
    _check_attempts(node, fail)
    _check_routing(node, fail)
    _check_holdings(node, fail)
    problem = deadline_problem(node.deadline)
    if problem:
        raise fail(problem)
    _check_flags(node, fail)
    if node.map is not None:
        _validate_map(node, dag, limits, fail)
        _check_map_forms(node, node.map, dag, is_registered, fail)
    if node.sensor is not None:
        _check_sensor(node, fail, d)
    check_transactional(node, d)


def _check_task_name(
    node: Node, dag: str, is_registered: Callable[[str], bool] | None, known: set[str] | None, fail: Fail
) -> None:
    """A valid Celery task name, not Celery's own, registered in the app (then added to ``known``)."""
    if not isinstance(node.task, str) or not TASK_NAME_RE.fullmatch(node.task):
        raise fail(f"task {short(node.task)} is not a valid Celery task name")
    if node.task.startswith("celery."):
        raise UnknownTaskError(f"task {node.task!r} is internal to Celery", dag=dag, node=node.key)
    if is_registered is not None and not is_registered(node.task):
        raise UnknownTaskError(
            f"task {node.task!r} is not registered in the Celery app (add its module to ORCHESTRATOR_TASK_MODULES;"
            " a task defined in the script being run takes that module's name only when the list names it)",
            dag=dag,
            node=node.key,
        )
    if known is not None:
        known.add(node.task)


def _check_arguments(node: Node, dag: DagShape, limits: SizeLimits, fail: Fail) -> None:
    """``args``, ``kwargs`` and ``upstream`` in their types; the arguments plain JSON within the
    size limit; each upstream key listed once and a node of the DAG."""
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
        check_json(list(node.args), "args", dag=dag.name, node=node.key)
        check_json(dict(node.kwargs), "kwargs", dag=dag.name, node=node.key)
        if json_size([list(node.args), dict(node.kwargs)]) > limits.max_node_bytes:
            raise fail(f"arguments exceed {limits.max_node_bytes} bytes of JSON")
    seen: set[str] = set()
    for parent in node.upstream:
        if parent in seen:
            raise fail(f"upstream {parent!r} is listed twice")
        seen.add(parent)
        if parent not in dag.nodes:
            raise fail(f"unknown upstream key {parent!r}")
    problem = placeholder_problem(node.args, node.upstream) if node.args else None
    if problem:
        raise fail(f"args: {problem}")


def _check_attempts(node: Node, fail: Fail) -> None:
    """How many attempts, how far apart (the backoff) and how long each may take."""
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
        if not positive(value) or value > MAX_BACKOFF:
            raise fail(f"backoff.{name} must be a number of seconds above 0 and at most {MAX_BACKOFF}")
    if b.cap < b.base:
        raise fail("backoff needs base <= cap")
    for name in ("soft_time_limit", "time_limit"):
        value = getattr(node, name)
        if value is not None and (not positive(value) or value < MIN_TIME_LIMIT):
            raise fail(f"{name} must be a number of seconds of at least {MIN_TIME_LIMIT:g}, not {short(value)}")
    if node.soft_time_limit is not None and node.time_limit is not None and node.soft_time_limit >= node.time_limit:
        raise fail("soft_time_limit must be below time_limit")


def _check_routing(node: Node, fail: Fail) -> None:
    """The priority class, the exception names that are (not) retried, the queue."""
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


def _check_holdings(node: Node, fail: Fail) -> None:
    """What the task holds or takes while it runs: a pool's slots, a rate limit's tokens, resources."""
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


def _check_flags(node: Node, fail: Fail) -> None:
    """The flags (branch, short circuit, setup, teardown, fails_run) and ``min_success_ratio``."""
    for flag in FLAGS:
        if not isinstance(getattr(node, flag), bool):
            raise fail(f"{flag} must be true or false, not {short(getattr(node, flag))}")
    if node.branch and node.short_circuit:
        raise fail("a node is a branch or a short circuit, not both")
    if not isinstance(node.ignore_downstream_trigger_rules, bool):
        raise fail("ignore_downstream_trigger_rules must be true or false")
    if not node.ignore_downstream_trigger_rules and not node.short_circuit:
        raise fail("ignore_downstream_trigger_rules is a short circuit's option (short_circuit=True)")
    if node.setup and node.teardown:
        raise fail("a node is a setup or a teardown, not both")
    if node.fails_run and not node.teardown:
        raise fail("fails_run is a teardown's option (every other task's failure fails its run)")
    ratio = node.min_success_ratio
    if ratio is not None:
        if not positive(ratio) or ratio > 1:
            raise fail(f"min_success_ratio must be a number above 0 and at most 1, not {short(ratio)}")
        if node.trigger_rule is not TriggerRule.ALL_SUCCESS:
            raise fail(f"min_success_ratio relaxes all_success, not {node.trigger_rule.value}")
        if not node.upstream:
            raise fail("min_success_ratio needs upstream tasks")


def _check_sensor(node: Node, fail: Fail, dag: str) -> None:
    """A :class:`SensorSpec` within its bounds, on a node that is no map, branch or short circuit."""
    if not isinstance(node.sensor, SensorSpec):
        raise fail(f"sensor must be a SensorSpec, not {type(node.sensor).__name__}")
    node.sensor.checked((dag, node.key))  # a hand-built one too
    for what in ("map", "branch", "short_circuit"):
        if getattr(node, what):
            raise fail(f"a sensor cannot be a {what.replace('_', ' ')}")


def _validate_child(node: Node, fail: Fail, dag: str | None = None) -> None:
    """A child-run node: the child task name with a :class:`ChildSpec` (one ``ChildSpec.make``
    would build), nothing a worker would run. An inline spec is judged whole at submit."""
    if not isinstance(node.child, ChildSpec) or node.task != CHILD_TASK:
        raise fail(f"{CHILD_TASK!r} is the task of a child-run node: build it with DAG.run_dag")
    node.child.checked((dag, node.key))
    if node.args or node.kwargs:
        raise fail("a child-run node takes no arguments (give the child's params)")
    for what in ("map", "branch", "short_circuit", "setup", "teardown", "sensor", "wait", "pool", "rate_limit"):
        if getattr(node, what):
            raise fail(f"a child-run node cannot have {what.replace('_', ' ')}")
    if node.resources:
        raise fail("a child-run node cannot have resources")


def _validate_wait(node: Node, fail: Fail, dag: str | None = None) -> None:
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


def _validate_map(node: Node, dag: DagShape, limits: SizeLimits, fail: Fail) -> None:
    """A mapped node: its :class:`MapSpec` in its types and bounds, each mapped argument a parent
    or a literal list, a trigger rule that waits for what it maps over, a map item by item as
    its source allows."""
    spec = node.map
    if not isinstance(spec, MapSpec):
        raise fail(f"map must be a MapSpec, not {type(spec).__name__}")
    if "[" in node.key:
        raise fail("a mapped node's key takes no index: its children are keyed KEY[item]")
    if not isinstance(spec.args, tuple) or not spec.args or not all(isinstance(a, MapArg) for a in spec.args):
        raise fail("map needs at least one mapped argument")
    for what in ("branch", "short_circuit", "setup", "teardown"):
        if getattr(node, what):
            raise fail(f"a mapped node cannot be a {what.replace('_', ' ')}")
    _check_map_keywords(node, spec, fail)
    length = _check_map_bounds(node, spec, limits, fail)
    from_nodes = _check_map_args(node, spec, dag, length, fail)
    if from_nodes and node.trigger_rule in MAP_REFUSED_RULES:
        raise fail(
            f"trigger_rule {node.trigger_rule.value} on a node mapped over a parent's result: it can start it"
            " before that parent succeeded, with nothing to map over"
        )
    if node.min_success_ratio is not None:
        raise fail("min_success_ratio belongs to the node after the map (the join), not to the map")
    _check_per_item(node, spec, dag, fail)


def _check_map_keywords(node: Node, spec: MapSpec, fail: Fail) -> None:
    """The mapped keywords (identifiers, each once, none a constant kwarg or ``upstream``), how
    several combine, what an empty input does."""
    names = [a.kwarg for a in spec.args]
    for name in names:
        if name == KWARGS and len(names) == 1:
            continue  # kwargs_from: each item a mapping of keyword arguments
        if name == KWARGS:
            raise fail("kwargs_from maps alone: its items are all the mapped keyword arguments")
        if not isinstance(name, str) or not name.isidentifier():
            raise fail(f"mapped keyword {short(name)} is not a Python identifier")
        if name in node.kwargs:
            raise fail(f"mapped keyword {name!r} is also a constant kwarg: keep one")
        if name == UPSTREAM_KWARG:
            raise fail(f"{UPSTREAM_KWARG!r} is reserved for the parents' results")
    if len(set(names)) != len(names):
        raise fail("a mapped keyword is listed twice")
    if len(spec.args) > 1 and spec.combine not in COMBINES:
        raise fail(f"several mapped arguments need combine= one of {', '.join(COMBINES)}, not {short(spec.combine)}")
    if spec.combine is not None and spec.combine not in COMBINES:
        raise fail(f"combine must be one of {', '.join(COMBINES)}, not {short(spec.combine)}")
    if spec.on_empty not in ON_EMPTY:
        raise fail(f"on_empty must be 'skip' or 'success', not {short(spec.on_empty)}")


def _check_map_forms(
    node: Node, spec: MapSpec, dag: DagShape, is_registered: Callable[[str], bool] | None, fail: Fail
) -> None:
    """Airflow's mapping forms: ``zip_fill`` (JSON, a zip of several arguments), ``items``,
    ``skip_none``, ``transform`` (a registered task), ``kwargs_from``'s literal items (mappings)."""
    if spec.zip_fill is not NO_FILL:
        if len(spec.args) < 2 or (spec.combine or "zip") != "zip":
            raise fail("zip_fill pads a zip of several mapped arguments (combine='zip')")
        check_json(spec.zip_fill, "zip_fill", dag=dag.name, node=node.key)
    if spec.items not in MAP_ITEMS:
        raise fail(f"items must be one of {', '.join(MAP_ITEMS)}, not {short(spec.items)}")
    if not isinstance(spec.skip_none, bool):
        raise fail(f"skip_none must be true or false, not {short(spec.skip_none)}")
    if spec.transform is not None:
        if len(spec.args) != 1:
            raise fail("transform applies to one mapped argument (or kwargs_from)")
        if not isinstance(spec.transform, str) or not TASK_NAME_RE.fullmatch(spec.transform):
            raise fail(f"transform {short(spec.transform)} is not a valid Celery task name")
        if is_registered is not None and not is_registered(spec.transform):
            raise UnknownTaskError(
                f"transform {spec.transform!r} is not a task registered in the Celery app", dag=dag.name, node=node.key
            )
    arg = spec.args[0]
    if arg.kwarg == KWARGS and arg.items is not None and spec.transform is None:
        bad = next((i for i, item in enumerate(arg.items) if not isinstance(item, Mapping)), None)
        if bad is not None:
            raise fail(f"kwargs_from item {bad} is {short(arg.items[bad])}: each item must be a mapping of keywords")


def _check_map_bounds(node: Node, spec: MapSpec, limits: SizeLimits, fail: Fail) -> int:
    """``max_map_length`` (returned), ``max_active``, ``map_key`` and the key's room for its
    children's keys."""
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
    return length


def _check_map_args(node: Node, spec: MapSpec, dag: DagShape, length: int, fail: Fail) -> bool:
    """Each mapped argument: a node upstream of this one, or a literal JSON list of at most
    ``length`` items. Returns whether one maps over a node."""
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
    return from_nodes


def _check_per_item(node: Node, spec: MapSpec, dag: DagShape, fail: Fail) -> None:
    """A map over a mapped node runs item by item: one mapped argument, that node its only
    upstream, its pace and keys the source's."""
    over_map = [a.source for a in spec.args if a.source is not None and dag.nodes[a.source].map is not None]
    if not over_map or spec.skip_none:
        return  # skip_none: it maps the whole map's results once its children are done
    if len(spec.args) > 1:
        raise fail(f"a node mapped over the mapped node {over_map[0]!r} maps item by item: one mapped argument")
    if tuple(node.upstream) != (over_map[0],):
        raise fail(
            f"a node mapped item by item over {over_map[0]!r} has it as its only upstream (each child waits"
            " for its own item)"
        )
    if spec.max_active is not None:
        raise fail("max_active applies to a map over a list; a map item by item follows its source's pace")
    if spec.map_key is not None:
        raise fail("map_key: a map item by item takes the keys of the map it follows")


def find_cycle_or_raise(dag: DagShape) -> None:
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
