"""The DAG model, its validation and the spec file format (pure code).

A :class:`DAG` is built in code (``dag.task(key, signature, upstream=[...])``: :mod:`.authoring`)
or read from a YAML/JSON spec (:func:`load_spec`: :mod:`.spec`). :meth:`DAG.validate`
(:mod:`.validation`) refuses bad input with a :class:`~orchestrator.core.errors.ValidationError`
naming the node, before anything is written. :mod:`.bounds` holds every bound a DAG may carry,
:mod:`.model` the frozen values (:class:`Node`, :class:`MapSpec`), :mod:`.signatures` how a
Celery signature becomes a node without importing Celery.
"""

from __future__ import annotations

from .authoring import (
    DAG,
)
from .bounds import (
    COMBINES,
    DEFAULT_MAX_MAP_LENGTH,
    KEY_RE,
    LIMIT_NAME_RE,
    MAP_ITEMS,
    MAP_KEY_FIELD_RE,
    MAP_REFUSED_RULES,
    MAP_WINDOW,
    MAX_ACTIVE_TASKS,
    MAX_ATTEMPTS,
    MAX_BACKOFF,
    MAX_DEADLINE,
    MAX_IDEMPOTENCY_KEY_CHARS,
    MAX_JSON_DEPTH,
    MAX_JSON_INT,
    MAX_LOGICAL_DATE_CHARS,
    MAX_MAP_LENGTH,
    MAX_NAME_CHARS,
    MAX_POOL_SLOTS,
    MAX_RESOURCES,
    MAX_SPEC_BYTES,
    MIN_TIME_LIMIT,
    ON_EMPTY,
    QUEUE_RE,
    RESOURCE_RE,
    TASK_NAME_RE,
    TENANT_RE,
    UPSTREAM_KWARG,
    Limits,
    SizeLimits,
    check_json,
    deadline_problem,
    expand_resources,
    resources_problem,
    short,
    text_problem,
)
from .model import (
    KWARGS,
    MAP_MARK,
    NO_FILL,
    MapArg,
    MapSpec,
    Node,
    OnDeadline,
)
from .signatures import (
    SIGNATURE_OPTIONS,
)
from .spec import (
    DAG_FIELDS,
    MAP_FIELDS,
    NODE_FIELDS,
    dag_from_spec,
    load_spec,
    parse_spec,
    read_spec_text,
)
from .validation import (
    find_cycle_or_raise,
)

__all__ = [
    "COMBINES",
    "DAG",
    "DAG_FIELDS",
    "DEFAULT_MAX_MAP_LENGTH",
    "KEY_RE",
    "KWARGS",
    "LIMIT_NAME_RE",
    "MAP_FIELDS",
    "MAP_ITEMS",
    "MAP_KEY_FIELD_RE",
    "MAP_MARK",
    "MAP_REFUSED_RULES",
    "MAP_WINDOW",
    "MAX_ACTIVE_TASKS",
    "MAX_ATTEMPTS",
    "MAX_BACKOFF",
    "MAX_DEADLINE",
    "MAX_IDEMPOTENCY_KEY_CHARS",
    "MAX_JSON_DEPTH",
    "MAX_JSON_INT",
    "MAX_LOGICAL_DATE_CHARS",
    "MAX_MAP_LENGTH",
    "MAX_NAME_CHARS",
    "MAX_POOL_SLOTS",
    "MAX_RESOURCES",
    "MAX_SPEC_BYTES",
    "MIN_TIME_LIMIT",
    "NODE_FIELDS",
    "NO_FILL",
    "ON_EMPTY",
    "QUEUE_RE",
    "RESOURCE_RE",
    "SIGNATURE_OPTIONS",
    "TASK_NAME_RE",
    "TENANT_RE",
    "UPSTREAM_KWARG",
    "Limits",
    "MapArg",
    "MapSpec",
    "Node",
    "OnDeadline",
    "SizeLimits",
    "check_json",
    "dag_from_spec",
    "deadline_problem",
    "expand_resources",
    "find_cycle_or_raise",
    "load_spec",
    "parse_spec",
    "read_spec_text",
    "resources_problem",
    "short",
    "text_problem",
]
