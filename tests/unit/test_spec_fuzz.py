"""Property-based fuzzing of every way a DAG comes in: the Python API (``DAG.task`` with any
values, ``submit`` with any idempotency key, tenant and logical date) and spec files (JSON and
YAML, through the CLI's loader). Every input is either accepted and stored, or refused with a
named error (a :class:`ValidationError`): never another exception, and a refusal writes no row.

The default suite runs a small budget; ``pytest -m fuzz`` runs 20,000 examples of each
(``ORCHESTRATOR_FUZZ_EXAMPLES`` changes it)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator import DAG, Orchestrator, Settings
from orchestrator.core.dag import load_spec
from orchestrator.core.errors import ValidationError
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from orchestrator.store import schema as s
from tests.conftest import clean_test_database

TASKS = ["t.ok", "t.other"]


def _budget(marker_run: bool) -> int:
    default = 20_000 if marker_run else 150
    return int(os.environ.get("ORCHESTRATOR_FUZZ_EXAMPLES", default))


@pytest.fixture(scope="module")
def orc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Orchestrator]:
    settings_ = Settings.from_env({}, data_dir=str(tmp_path_factory.mktemp("fuzz")), database_url=clean_test_database())
    o = Orchestrator(settings_, publisher=RecordingPublisher(), registry=StaticRegistry(TASKS))
    o.limits.set_pool("fuzz-pool", 2)  # migrates once, and a pool and a rate limit that exist
    o.limits.set_rate_limit("fuzz-rate", "100/s")
    yield o
    o.store.dispose()


def _rows(orc: Orchestrator) -> int:
    with orc.store.engine.connect() as conn:
        return sum(conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one() for t in (s.runs, s.tasks))


# ------------------------------------------------------------------ values an attacker or a careless user sends

_text = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["a", "a\n", "a\x00", "\ud800", "t.ok", "t.ok\n", "x" * 300, "", " ", "ok-key", "é"]),
)
_number = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, 2, 5, 1e-299, 1e13, 2**31, 5000, 0.5, True, False]),
)
_json_leaf = st.one_of(st.none(), st.booleans(), _number, _text)
_json = st.recursive(
    _json_leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_text, inner, max_size=4)),
    max_leaves=12,
)
_anything = st.one_of(
    _json, st.just(object()), st.just(b"bytes"), st.just({1, 2}), st.just(ValueError), st.just([None])
)


def _deep(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def _mostly(valid: Any, invalid: Any) -> Any:
    """About seven valid draws for one invalid, so a good share of the inputs is accepted and
    stored (hypothesis's one_of does not weigh repeated branches; its simplest integer, 0,
    picks the valid side)."""
    return st.integers(min_value=0, max_value=7).flatmap(lambda i: invalid if i == 7 else valid)


_field_values = {
    "args": _mostly(
        st.lists(_json, max_size=3), st.one_of(_anything, st.just("abc"), st.just({}), st.just([_deep(990)]))
    ),
    "kwargs": _mostly(
        st.dictionaries(st.sampled_from(["a", "b"]), _json_leaf, max_size=2),
        st.one_of(_anything, st.just([1, 2]), st.just({"\x00": 1})),
    ),
    "upstream": _mostly(st.just([]), st.one_of(_anything, st.just(False), st.just("a"))),
    "trigger_rule": _mostly(
        st.sampled_from(["all_success", "one_failed", "all_done"]), st.one_of(_anything, st.just("nope"))
    ),
    "max_attempts": _mostly(st.integers(min_value=1, max_value=5), st.one_of(_number, _anything)),
    "backoff": _mostly(
        st.fixed_dictionaries({"base": st.floats(0.1, 10), "cap": st.just(60.0)}),
        st.one_of(_anything, st.fixed_dictionaries({"base": _number, "cap": _number})),
    ),
    "soft_time_limit": _mostly(st.none(), st.one_of(_number, _anything)),
    "time_limit": _mostly(st.sampled_from([None, 10, 60.5]), st.one_of(_number, _anything)),
    "priority": _mostly(st.sampled_from(["high", "default", "low"]), st.one_of(_anything, st.just("urgent"))),
    "queue": _mostly(st.none(), st.one_of(_text, _anything, st.just("orchestrator.tenant.acme.high"))),
    "retry_on": _mostly(st.just(["ValueError"]), st.one_of(_anything, st.just([None]), st.just([ValueError]))),
    "no_retry_on": _mostly(st.just([]), st.one_of(_anything, st.just(["x\n"]))),
    "pool": _mostly(st.sampled_from([None, "fuzz-pool"]), st.one_of(_text, _anything, st.just("no-such-pool"))),
    "pool_slots": _mostly(st.sampled_from([1, 2]), st.one_of(_number, _anything)),
    "rate_limit": _mostly(st.sampled_from([None, "fuzz-rate"]), st.one_of(_text, _anything, st.just("nope"))),
    "deadline": _mostly(st.sampled_from([None, 60, 0.5, 86400]), st.one_of(_number, _anything, st.just("1h"))),
}


@st.composite
def _api_node(draw: Any) -> dict[str, Any]:
    chosen = draw(st.sets(st.sampled_from(sorted(_field_values)), max_size=3))
    node = {name: draw(_field_values[name]) for name in chosen}
    node["key"] = draw(_mostly(st.sampled_from(["a", "b", "c"]), st.one_of(_text, _anything)))
    node["task"] = draw(_mostly(st.sampled_from(TASKS), st.one_of(_text, _anything)))
    return node


@st.composite
def _api_call(draw: Any) -> dict[str, Any]:
    nodes = draw(st.lists(_api_node(), min_size=draw(st.sampled_from([0, 1, 1, 1])), max_size=3))
    # distinct keys most of the time (a duplicate key is a refusal of its own)
    if draw(st.integers(0, 3)):
        seen: set[Any] = set()
        nodes = [n for n in nodes if not (isinstance(n["key"], str) and (n["key"] in seen or seen.add(n["key"])))]
    return {
        "name": draw(_mostly(st.just("fuzz"), st.one_of(_text, _anything))),
        "tenant": draw(_mostly(st.just("default"), st.one_of(_text, _anything))),
        "params": draw(_mostly(st.just({}), _anything)),
        "max_active_tasks": draw(_mostly(st.sampled_from([None, 1, 5]), st.one_of(_number, _anything))),
        "deadline": draw(_mostly(st.sampled_from([None, 600, 1.5]), st.one_of(_number, _anything))),
        "on_deadline": draw(_mostly(st.sampled_from(["alert", "cancel"]), st.one_of(_text, _anything))),
        "nodes": nodes,
        "idempotency_key": draw(_mostly(st.none(), st.one_of(_text, _anything))),
        "logical_date": draw(_mostly(st.sampled_from([None, "2026-11-23"]), st.one_of(_text, _anything))),
    }


def _submit_api(orc: Orchestrator, call: dict[str, Any]) -> None:
    dag = DAG(
        call["name"],
        tenant=call["tenant"],
        params=call["params"],
        max_active_tasks=call["max_active_tasks"],
        deadline=call["deadline"],
        on_deadline=call["on_deadline"],
    )
    for node in call["nodes"]:
        fields = {k: v for k, v in node.items() if k not in ("key", "task")}
        dag.task(node["key"], node["task"], **fields)
    orc.submit(dag, idempotency_key=call["idempotency_key"], logical_date=call["logical_date"])


#: how the inputs of this session ended (printed by the long runs: pytest -m fuzz -s)
OUTCOMES: dict[str, int] = {"accepted": 0, "refused": 0}


def _check(orc: Orchestrator, action: Any) -> None:
    before = _rows(orc)
    try:
        action()
    except ValidationError as exc:
        assert str(exc), "a refusal names its problem"
        assert _rows(orc) == before, f"a refusal wrote rows: {exc}"
        OUTCOMES["refused"] += 1
    else:
        OUTCOMES["accepted"] += 1
    # any other exception escapes and fails the test: a traceback is a bug


def _api_property(orc: Orchestrator, n: int) -> None:
    @settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(_api_call())
    def prop(call: dict[str, Any]) -> None:
        _check(orc, lambda: _submit_api(orc, call))

    prop()


def _spec_property(orc: Orchestrator, tmp: Path, n: int) -> None:
    @settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(_api_call(), st.sampled_from(["json", "yaml"]), st.integers(min_value=0, max_value=3))
    def prop(call: dict[str, Any], fmt: str, mangle: int) -> None:
        spec: Any = {
            "name": call["name"],
            "tenant": call["tenant"],
            "params": call["params"],
            "max_active_tasks": call["max_active_tasks"],
            "deadline": call["deadline"],
            "on_deadline": call["on_deadline"],
            "nodes": call["nodes"],
        }
        text = _render(spec, fmt)
        if text is None:
            return  # not representable in this format at all
        if mangle == 1:
            text = text[: len(text) // 2]  # truncated file
        elif mangle == 2 and fmt == "yaml":
            text = "a: &a [1, 2]\nb: *a\n" + text  # an alias
        elif mangle == 3 and fmt == "json":
            text = text.replace("{", '{"name": "dup", ', 1)  # a duplicate key
        path = tmp / f"spec.{fmt}"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        _check(orc, lambda: orc.submit(load_spec(path)))

    prop()


def _render(spec: Any, fmt: str) -> str | None:
    import yaml

    try:
        if fmt == "json":
            return json.dumps(spec, allow_nan=True)
        return str(yaml.safe_dump(spec, allow_unicode=True))
    except (TypeError, ValueError, yaml.YAMLError, UnicodeEncodeError, RecursionError):
        return None


def test_the_python_api_accepts_or_refuses_with_a_named_error(orc: Orchestrator) -> None:
    _api_property(orc, _budget(False))


def test_spec_files_are_accepted_or_refused_with_a_named_error(orc: Orchestrator, tmp_path: Path) -> None:
    _spec_property(orc, tmp_path, _budget(False))


@pytest.mark.fuzz
def test_fuzz_the_python_api_long(orc: Orchestrator) -> None:
    OUTCOMES.update(accepted=0, refused=0)
    _api_property(orc, _budget(True))
    print(
        f"\nPython API: {OUTCOMES['accepted']} accepted, {OUTCOMES['refused']} refused with a named error, 0 tracebacks"
    )


@pytest.mark.fuzz
def test_fuzz_spec_files_long(orc: Orchestrator, tmp_path: Path) -> None:
    OUTCOMES.update(accepted=0, refused=0)
    _spec_property(orc, tmp_path, _budget(True))
    print(
        f"\nspec files: {OUTCOMES['accepted']} accepted, {OUTCOMES['refused']} refused with a named error, 0 tracebacks"
    )


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"name": "x", "name": "y", "nodes": []}', "duplicate key"),
        ("name: x\nname: y\nnodes: []\n", "duplicate key"),
        ("a: &a [1]\nb: *a\n", "anchors and aliases"),
        ('{"name": "x", "nodes": [{"key": "a", "task": "t.ok", "args": {}}]}', "'args' must be a list"),
        ('{"name": "x", "nodes": [{"key": "a", "task": "t.ok", "upstream": false}]}', "'upstream' must be a list"),
        (
            '{"name": "x", "nodes": [{"key": "a", "task": "t.ok", "max_attempts": true}]}',
            "'max_attempts' must be an integer",
        ),
    ],
)
def test_spec_files_are_strict(orc: Orchestrator, tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / ("spec.json" if text.startswith("{") else "spec.yaml")
    path.write_text(text)
    with pytest.raises(ValidationError, match=says):
        orc.submit(load_spec(path))


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path: Path) -> None:
    import time

    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 9):
        prev = chr(ord("a") + i - 1)
        cur = chr(ord("a") + i)
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    started = time.monotonic()
    with pytest.raises(ValidationError, match="anchors and aliases"):
        load_spec(path)
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize(
    ("build", "says"),
    [
        (lambda d: d.task("a", "t.ok", max_attempts=2**31), "max_attempts must be 1 to 1000"),
        (lambda d: d.task("a", "t.ok", backoff={"base": 1e13, "cap": 1e13}), "backoff.base"),
        (lambda d: d.task("a", "t.ok", args=[_deep(990)]), "nested more than 32 deep"),
        (lambda d: d.task("a", "t.ok", args=[10**5000]), "outside 64 bits"),
        (lambda d: d.task("a", "t.ok", args=["\ud800"]), "lone surrogate"),
        (lambda d: d.task("a", "t.ok", args=["a\x00b"]), "NUL"),
        (lambda d: d.task("a", "t.ok", kwargs=[1]), "kwargs must be a mapping"),  # type: ignore[arg-type]
        (lambda d: d.task("a", "t.ok", args="abc"), "args must be a list"),  # type: ignore[arg-type]
        (lambda d: d.task("a", "t.ok", retry_on=[None]), "retry_on must list"),  # type: ignore[list-item]
        (lambda d: d.task("a\n", "t.ok"), "node key"),
        (lambda d: d.task("a", "t.ok\n"), "not a valid Celery task name"),
        (lambda d: d.task("a", "t.ok", time_limit=1e-299), "at least 1"),
        (lambda d: d.task("a", "t.ok", soft_time_limit=5000), "soft_time_limit 5000s must be below"),
        (lambda d: d.task("a", "t.ok", deadline=0), "deadline must be a number of seconds above 0"),
        (lambda d: d.task("a", "t.ok", deadline=1e13), "deadline must be a number of seconds above 0 and at most"),
        (lambda d: d.task("a", "t.ok", deadline=float("nan")), "deadline must be a number"),
    ],
)
def test_named_refusals(orc: Orchestrator, build: Any, says: str) -> None:
    dag = DAG("named")
    with pytest.raises(ValidationError, match=says):
        build(dag)
        orc.submit(dag)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"idempotency_key": "k\x00"}, "idempotency key holds the control character"),
        ({"logical_date": "not a date"}, "not an ISO-8601"),
        ({"logical_date": "2026-01-01\x00"}, "logical_date holds the control character"),
    ],
)
def test_submit_arguments_are_checked(orc: Orchestrator, kwargs: dict[str, Any], says: str) -> None:
    dag = DAG("args")
    dag.task("a", "t.ok")
    with pytest.raises(ValidationError, match=says):
        orc.submit(dag, **kwargs)


# ------------------------------------------------------------------ DAGs assembled by hand (issue 18)

_VALID_NODE: dict[str, Any] = {"task": "t.ok"}
#: one wrong value per Node field, as a hand-built Node may hold it (``dag.task`` never makes these)
_BAD_FIELDS: dict[str, Any] = {
    "task": st.one_of(st.sampled_from([1, None, ["t.ok"], b"t.ok", "t.nope", "celery.x", "t ok"]), _anything),
    "args": st.sampled_from([1, "abc", {"a": 1}, None, {1, 2}, (object(),)]),
    "kwargs": st.sampled_from([[1], "k", None, {1: "x"}, {"a": object()}]),
    "upstream": st.sampled_from(["a", [1], (None,), 5, ("zz",), ("a", "a"), [["a"]]]),
    "trigger_rule": st.sampled_from(["all_success", "nope", 1, None]),
    "max_attempts": st.sampled_from(["1", 0, 1001, 1.5, True, None]),
    "backoff": st.sampled_from([{"base": 1, "cap": 2}, None, 1, "x"]),
    "soft_time_limit": st.sampled_from(["5", -1, 0.5, float("nan"), [1]]),
    "time_limit": st.sampled_from(["5", 0, float("inf"), {}]),
    "priority": st.sampled_from(["high", "urgent", 1, [None]]),
    "queue": st.sampled_from([1, "a b", "", ["q"]]),
    "retry_on": st.sampled_from(["ValueError", 5, [None], [1], ("a b",)]),
    "no_retry_on": st.sampled_from(["x", None, [ValueError]]),
    "pool": st.sampled_from([1, "", "a b", ["p"]]),
    "pool_slots": st.sampled_from([0, "1", 1.5, True, None, 2]),  # 2 without a pool
    "rate_limit": st.sampled_from([1, "", ["r"]]),
    "deadline": st.sampled_from(["1h", 0, -5, float("nan"), 1e13, [1]]),
}


@st.composite
def _hand_built(draw: Any) -> tuple[DAG, str]:
    """A DAG of Node objects put into ``dag.nodes`` by hand, with one thing wrong (returned)."""
    from orchestrator.core.dag import Node

    dag = DAG("by-hand")
    keys = draw(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=3, unique=True))
    for i, key in enumerate(keys):
        dag.nodes[key] = Node(key=key, task="t.ok", upstream=tuple(keys[:i][-1:]))
    wrong = draw(st.sampled_from([*sorted(_BAD_FIELDS), "key-mismatch", "duplicate-key", "not-a-node", "cycle"]))
    victim = draw(st.sampled_from(keys))
    node = dag.nodes[victim]
    if wrong in _BAD_FIELDS:
        dag.nodes[victim] = replace(node, **{wrong: draw(_BAD_FIELDS[wrong])})
    elif wrong == "key-mismatch":
        dag.nodes[victim] = replace(node, key=draw(st.one_of(st.sampled_from(["zz", "a\n", ""]), _anything)))
    elif wrong == "duplicate-key":  # two entries holding one node key: two tasks of one key in the run
        dag.nodes["zz"] = node
    elif wrong == "not-a-node":
        dag.nodes[victim] = draw(st.sampled_from([None, {"key": victim, "task": "t.ok"}, node.to_spec(), victim]))
    else:
        first = keys[0]
        dag.nodes[first] = replace(dag.nodes[first], upstream=(keys[-1],))
    return dag, wrong


def test_a_dag_assembled_by_hand_is_validated_at_submit(orc: Orchestrator) -> None:
    """``submit`` and ``check`` validate whatever ``dag.nodes`` holds: every Node field's type,
    keys matching the dict's keys, upstream references, cycles; a ValidationError before
    anything is written."""

    @settings(max_examples=_budget(False) * 2, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(_hand_built())
    def prop(case: tuple[DAG, str]) -> None:
        dag, wrong = case
        before = _rows(orc)
        with pytest.raises(ValidationError) as caught:
            orc.check(dag)
        assert str(caught.value)
        with pytest.raises(ValidationError):
            orc.submit(dag)
        with pytest.raises(ValidationError):
            orc.submit(dag, tenant="other", idempotency_key="by-hand")
        assert _rows(orc) == before, f"{wrong}: a refusal wrote rows"

    prop()


def test_two_entries_of_one_node_key_are_a_validation_error_not_a_unique_violation(orc: Orchestrator) -> None:
    """The shape the fuzzer found ending in a raw psycopg UniqueViolation: ``dag.nodes`` holding
    one Node under two dict keys (or a Node under another key) made two task rows of one key."""
    from orchestrator.core.dag import Node

    dag = DAG("dup")
    node = Node(key="a", task="t.ok")
    dag.nodes = {"a": node, "b": node}
    before = _rows(orc)
    with pytest.raises(ValidationError, match="stored under its own key"):
        orc.submit(dag)
    assert _rows(orc) == before
