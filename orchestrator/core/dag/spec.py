"""The spec format: a DAG as a YAML or JSON file (``orchestrator submit dag.yaml``). Text is read
bounded (:func:`read_spec_text`), parsed strictly (:func:`parse_spec`: no duplicate keys, no YAML
anchors or aliases) and built into a :class:`DAG` (:func:`dag_from_spec`) through the same
builder and validation as the Python API; :meth:`DAG.to_spec` writes it back."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ..children import CHILD_TASK, child_from_spec
from ..errors import SpecError
from ..routing import DEFAULT_TENANT
from ..waits import WAIT_TASK, sensor_from_spec, wait_from_spec
from .authoring import DAG
from .bounds import DEFAULT_MAX_MAP_LENGTH, MAX_NAME_CHARS, MAX_SPEC_BYTES, short, text_problem
from .labels import labels_from_spec
from .model import KWARGS, NO_FILL, MapArg, MapSpec, OnDeadline

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
    "ignore_downstream_trigger_rules",
    "setup",
    "teardown",
    "fails_run",
    "transactional",
    "min_success_ratio",
    "wait",
    "sensor",
    "run_dag",
}
MAP_FIELDS = {
    "over", "kwarg", "combine", "map_key", "on_empty", "max_length", "max_active", "kwargs_from", "zip_fill", "items",
    "skip_none", "transform",
}  # fmt: skip
DAG_FIELDS = {
    "name", "tenant", "priority", "params", "max_active_tasks", "deadline", "on_deadline", "run_state", "nodes",
    "labels",
}  # fmt: skip


def dag_from_spec(spec: Any) -> DAG:
    """Build a :class:`DAG` from a parsed spec; raise :class:`SpecError` on a wrong shape.

    Types are strict: a field holds its own type or is absent (``args: {}`` or
    ``upstream: false`` are refused, never read as empty); ``null`` means absent only where
    the field is optional. The values then go through :meth:`DAG.task` and
    :meth:`DAG.validate`, exactly as from the Python API."""
    dag = _dag_of(spec)
    nodes = spec.get("nodes")
    if not isinstance(nodes, list):
        raise SpecError("'nodes' must be a list", dag=dag.name)
    dag.keys_as_written = True  # a spec holds the full keys: a task group's prefix included
    try:
        for i, raw in enumerate(nodes):
            _add_node(dag, i, raw)
    finally:
        dag.keys_as_written = False
    if spec.get("labels") is not None:
        labels_from_spec(dag, spec["labels"])
    return dag


def _dag_of(spec: Any) -> DAG:
    """The DAG of a spec's top-level fields, without its nodes."""
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
    run_state = spec.get("run_state", "all")
    if not isinstance(run_state, str):
        raise SpecError(f"'run_state' must be 'all' or 'leaves', not {short(run_state)}", dag=name)
    return DAG(
        name,
        run_state=run_state,
        tenant=spec.get("tenant", DEFAULT_TENANT),
        priority=spec.get("priority", "default"),
        params=params,
        max_active_tasks=mat,
        deadline=deadline,
        on_deadline=OnDeadline.ALERT if on_deadline is None else on_deadline,
    )


#: a node's yes/no options (and ``min_success_ratio``) as a spec gives them to :meth:`DAG.task`
SPEC_FLAGS = (
    "branch",
    "short_circuit",
    "ignore_downstream_trigger_rules",
    "setup",
    "teardown",
    "fails_run",
    "transactional",
    "min_success_ratio",
)


def _add_node(dag: DAG, i: int, raw: Any) -> None:
    """``nodes[i]`` of a spec added to ``dag`` through :meth:`DAG.task`."""
    name = dag.name
    key, raw = _node_fields(raw, i, name)
    upstream = raw.get("upstream", [])
    if not all(isinstance(u, str) for u in upstream):
        raise SpecError("'upstream' must be a list of node keys", dag=name, node=key)
    options: dict[str, Any] = {flag: raw[flag] for flag in SPEC_FLAGS if flag in raw}
    if "wait" in raw:
        options["wait"] = wait_from_spec(raw["wait"], (name, key))
    if "sensor" in raw:
        options["sensor"] = sensor_from_spec(raw["sensor"], (name, key))
    if "run_dag" in raw:
        options["child"] = child_from_spec(raw["run_dag"], (name, key))
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


def _node_fields(raw: Any, i: int, dag: str) -> tuple[str, Mapping[str, Any]]:
    """A node's key and fields, each known and of its type (:data:`_SPEC_TYPES`); a wait node's
    task filled in."""
    if not isinstance(raw, Mapping):
        raise SpecError(f"nodes[{i}] must be a mapping", dag=dag)
    key = raw.get("key")
    if not isinstance(key, str):
        raise SpecError(f"nodes[{i}] needs a string 'key'", dag=dag)
    bad = set(raw) - NODE_FIELDS
    if bad:
        raise SpecError(f"unknown field(s) {sorted(map(str, bad))}", dag=dag, node=key)
    if "wait" in raw:
        if raw.get("task", WAIT_TASK) != WAIT_TASK:
            raise SpecError("a wait node has no 'task' (it runs on no worker)", dag=dag, node=key)
        raw = {**raw, "task": WAIT_TASK}
    if "run_dag" in raw:
        if raw.get("task", CHILD_TASK) != CHILD_TASK:
            raise SpecError("a run_dag node has no 'task' (it runs on no worker)", dag=dag, node=key)
        raw = {**raw, "task": CHILD_TASK}
    if "task" not in raw:
        raise SpecError("missing 'task'", dag=dag, node=key)
    for field_name, types, what in _SPEC_TYPES:
        if field_name in raw and not (
            isinstance(raw[field_name], types) and not _bool_as_number(raw[field_name], types)
        ):
            raise SpecError(f"'{field_name}' must be {what}, not {short(raw[field_name])}", dag=dag, node=key)
    return key, raw


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
    if "kwargs_from" in raw:
        if over is not None or kwarg is not None:
            raise SpecError(
                "'map': kwargs_from maps keyword arguments by itself; drop over and kwarg", dag=dag, node=key
            )
        over, kwarg = raw["kwargs_from"], KWARGS
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
                              ("max_length", (int,)), ("max_active", (int,)), ("items", (str,)),
                              ("skip_none", (bool,)), ("transform", (str,))):  # fmt: skip
        value = raw.get(field_name)
        if value is not None and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            raise SpecError(f"'map.{field_name}' has the wrong type: {short(value)}", dag=dag, node=key)
    return MapSpec(
        args=tuple(args),
        combine=raw.get("combine"),
        map_key=raw.get("map_key"),
        on_empty=raw.get("on_empty", "skip"),
        max_length=raw.get("max_length", DEFAULT_MAX_MAP_LENGTH),
        max_active=raw.get("max_active"),
        zip_fill=raw["zip_fill"] if "zip_fill" in raw else NO_FILL,
        items=raw.get("items", "values"),
        skip_none=raw.get("skip_none", False),
        transform=raw.get("transform"),
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
    ("ignore_downstream_trigger_rules", (bool,), "true or false"),
    ("setup", (bool,), "true or false"),
    ("teardown", (bool,), "true or false"),
    ("fails_run", (bool,), "true or false"),
    ("transactional", (bool,), "true or false"),
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
