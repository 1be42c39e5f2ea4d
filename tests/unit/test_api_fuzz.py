"""Property-based fuzzing of the API's entry points: the Python API (``submit`` of specs with
waits, sensors and maps, ``emit``, ``signal``, ``approve`` / ``reject``, the operator actions,
``schedules.add``, ``triggers.add``) and the JSON API of ``orchestrator serve`` (``POST
/api/events``, the actions, the reads), over a real database.

Every input ends either accepted, or refused with one of the project's typed errors
(:class:`OrchestratorError`; over HTTP a 4xx with a JSON ``error``): never another exception,
never a 5xx, and a refusal writes no row (the ledger's rejected rows of a refused operator
action excepted: they are the record of the refusal). Every input of a run is tried: the
raw exceptions found are collected and reported together.

The default suite runs a small budget; ``pytest -m fuzz tests/unit/test_api_fuzz.py -s`` runs
100,000 inputs (``ORCHESTRATOR_FUZZ_API_EXAMPLES`` changes it) and prints the counts."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import traceback
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator import DAG, Orchestrator, Settings
from orchestrator.core.dag import dag_from_spec
from orchestrator.core.errors import ConfigurationError, OrchestratorError
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from orchestrator.core.routing import default_queues
from orchestrator.store import schema as s
from orchestrator.web.app import SERVER_OPTIONS
from tests.conftest import clean_test_database
from tests.unit.test_spec_fuzz import _anything, _api_call, _deep, _json, _mostly, _number, _text

TASKS = ["t.ok", "t.other"]
TOKEN = "fuzz-token-0123456789abcdef"


def _budget(marker_run: bool) -> int:
    default = 100_000 if marker_run else 300
    return int(os.environ.get("ORCHESTRATOR_FUZZ_API_EXAMPLES", default))


# ------------------------------------------------------------------ the world the inputs meet


class World:
    """The orchestrator on the emptied test database, a run with waits to signal and approve,
    and ``serve``'s app listening on a thread of its own."""

    def __init__(self, orc: Orchestrator) -> None:
        self.orc = orc
        self.setup()
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._started.wait(30)

    def reset(self) -> None:
        """Empty the database and set the world up again (the long run does it every
        :data:`CHUNK` inputs, so the tables it counts stay small)."""
        clean_test_database()
        self.setup()

    def setup(self) -> None:
        orc = self.orc
        orc.register_worker("w", default_queues(), 10)
        orc.limits.set_pool("fuzz-pool", 2)
        orc.limits.set_rate_limit("fuzz-rate", "100/s")
        spec = {
            "name": "target",
            "nodes": [
                {"key": "ev", "wait": {"event": "go", "match": {"n": 1}}},
                {"key": "ok", "wait": {"approval": True}},
                {"key": "a", "task": "t.ok"},
                {"key": "b", "task": "t.ok", "upstream": ["a"]},
            ],
        }
        self.run_id = orc.submit(dag_from_spec(spec)).id

    def _serve(self) -> None:
        from tornado.httpserver import HTTPServer
        from tornado.netutil import bind_sockets

        from orchestrator.web.app import make_app

        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        sockets = bind_sockets(0, "127.0.0.1")
        self.port = sockets[0].getsockname()[1]

        async def start() -> None:
            app = make_app(self.orc, auth=TOKEN, bind="127.0.0.1", cookie_secret="fuzz")
            HTTPServer(app, **SERVER_OPTIONS).add_sockets(sockets)

        loop.run_until_complete(start())
        self._started.set()
        loop.run_forever()

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def http(self, method: str, path: str, body: bytes | None = None, ctype: str = "application/json") -> int:
        """The status of one request with the token (any 5xx, or a 4xx without a JSON error,
        fails the input)."""
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": ctype}
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=body, method=method, headers=headers
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return int(r.status)
        except (ConnectionResetError, BrokenPipeError):
            # a body over the server's limit is refused (400) before it is read: the client
            # may see the connection closed while it still sends
            assert body is not None and len(body) > SERVER_OPTIONS["max_body_size"], f"{method} {path[:80]}"
            return 400
        except urllib.error.HTTPError as e:
            too_large = body is not None and len(body) > SERVER_OPTIONS["max_body_size"]
            try:
                payload = e.read()
            except (ConnectionResetError, BrokenPipeError):
                assert too_large, f"{method} {path[:80]}"
                return int(e.code)
            if too_large and e.code == 400:
                return 400  # Tornado's own answer: no JSON
            if e.code >= 500:
                raise AssertionError(f"HTTP {e.code} for {method} {path[:80]}: {payload[:300]!r}") from None
            if path.startswith("/api/"):
                assert "error" in json.loads(payload), payload[:200]
            return int(e.code)


#: rows per table, in one statement (built once: it runs twice per input)
COUNTS = sa.text(" UNION ALL ".join(f"SELECT '{t.name}', count(*) FROM {t.name}" for t in s.metadata.sorted_tables))


def counts(orc: Orchestrator) -> dict[str, int]:
    """Rows per table."""
    with orc.store.engine.connect() as conn:
        return {str(r[0]): int(r[1]) for r in conn.execute(COUNTS)}


#: the tables a refused operator action writes (its rejected ledger row)
LEDGER = {"orc_task_events"}


# ------------------------------------------------------------------ inputs

_deep_json = (
    st.sampled_from([40, 500, 5000, 50_000])
    .map(lambda n: st.sampled_from([_deep(n), {"a": _deep(n)}, json.loads("[" * min(n, 900) + "]" * min(n, 900))]))
    .flatmap(lambda s_: s_)
)
_payload = _mostly(
    st.one_of(st.none(), st.dictionaries(_text, _json, max_size=3), st.just({"n": 1})),
    st.one_of(_anything, _deep_json, st.just({"x": "y" * 70_000}), st.just({"x": float("nan")})),
)
_event_key = _mostly(st.sampled_from(["go", "order.paid", "a-b_c.d"]), st.one_of(_text, _anything))
#: ids and keys are strings (the type says so, and a path or a form holds nothing else), of any value
_hostile = st.one_of(_text, st.sampled_from(["x" * 100, "a\x00", "\ud800", "a[", "a[1", "%00", "../x", ""]))
_run_id = _mostly(st.just("RUN"), _hostile)
_key = _mostly(st.sampled_from(["ev", "ok", "a", "b", "a[1]"]), _hostile)
_seconds = _mostly(st.sampled_from([None, 1, 60, 0.5, 3600]), st.one_of(_number, _anything, st.just("1h")))

_wait = st.fixed_dictionaries(
    {},
    optional={
        "event": _event_key,
        "match": _mostly(st.just({"n": 1}), st.one_of(_anything, _deep_json, st.just({"a": list(range(20_000))}))),
        "until": _mostly(st.sampled_from(["2030-01-01T00:00:00Z", "09:00"]), st.one_of(_text, _anything)),
        "delay": _seconds,
        "tz": _mostly(st.sampled_from(["UTC", "Europe/Paris"]), st.one_of(_text, _anything)),
        "timeout": _seconds,
        "on_timeout": _mostly(st.sampled_from(["fail", "skip"]), st.one_of(_text, _anything)),
        "lookback": _seconds,
        "approval": _mostly(st.booleans(), _anything),
    },
)
_sensor = st.fixed_dictionaries(
    {"every": _mostly(st.sampled_from([1, 30, 0.5]), st.one_of(st.none(), _number, _anything))},
    optional={
        "timeout": _seconds,
        "backoff": _mostly(st.sampled_from([1, 2.0]), st.one_of(_number, _anything)),
        "max_every": _seconds,
        "on_timeout": _mostly(st.sampled_from(["fail", "skip"]), st.one_of(_text, _anything)),
    },
)
_map = st.fixed_dictionaries(
    {"over": _mostly(st.sampled_from(["a", "a.items"]), st.one_of(_text, _anything))},
    optional={"arg": _mostly(st.just("x"), _anything), "key": _mostly(st.just("id"), _anything)},
)


@st.composite
def _spec(draw: Any) -> dict[str, Any]:
    """A spec as a file would hold it: the Python API's fields, and wait / sensor / map nodes."""
    call = draw(_api_call())
    nodes = [dict(n) for n in call["nodes"]]
    for extra in draw(st.lists(st.sampled_from(["wait", "sensor", "map", "deep"]), max_size=2)):
        key = draw(_mostly(st.sampled_from(["w1", "w2", "s1", "m1"]), _text))
        if extra == "wait":
            nodes.append({"key": key, "wait": draw(_mostly(_wait, _anything))})
        elif extra == "sensor":
            nodes.append({"key": key, "task": "t.ok", "sensor": draw(_mostly(_sensor, _anything))})
        elif extra == "map":
            nodes.append({"key": key, "task": "t.ok", "map": draw(_mostly(_map, _anything))})
        else:
            nodes.append({"key": key, "task": "t.ok", "args": [draw(_deep_json)]})
    return {
        "name": call["name"],
        "tenant": call["tenant"],
        "params": call["params"],
        "nodes": nodes,
    }


@st.composite
def _hand_built_wait(draw: Any) -> DAG:
    """A DAG whose wait or sensor node holds a WaitSpec / SensorSpec built by hand (no checks)."""
    from orchestrator.core.waits import SensorSpec, WaitSpec

    dag = DAG("by-hand")
    if draw(st.booleans()):
        node = dag.wait("w", event="go")
        spec = replace(
            node.wait,
            **draw(
                st.fixed_dictionaries(
                    {},
                    optional={
                        "event": st.one_of(_text, _anything),
                        "match": st.one_of(_anything, _deep_json),
                        "timeout": st.one_of(_number, _anything),
                        "on_timeout": st.one_of(_text, _anything),
                        "lookback": st.one_of(_number, _anything),
                    },
                )
            ),
        )
        dag.nodes["w"] = replace(node, wait=spec)
    else:
        node = dag.sensor("s", "t.ok", every=5)
        fields = draw(
            st.fixed_dictionaries(
                {},
                optional={
                    "every": st.one_of(st.none(), _number, _anything),
                    "timeout": st.one_of(_number, _anything),
                    "backoff": st.one_of(_number, _anything),
                    "max_every": st.one_of(_number, _anything),
                    "on_timeout": st.one_of(_text, _anything),
                },
            )
        )
        dag.nodes["s"] = replace(node, sensor=SensorSpec(**{**node.sensor.__dict__, **fields}))  # type: ignore[union-attr]
        assert isinstance(dag.nodes["s"].sensor, SensorSpec) and WaitSpec is not None
    return dag


_bad_cron = st.one_of(_text, _anything, st.just("* * * * * * *"))
_small_spec = {"name": "sched", "nodes": [{"key": "a", "task": "t.ok"}]}
_schedule = st.fixed_dictionaries(
    {"name": _mostly(st.sampled_from(["s1", "s2"]), st.one_of(_text, _anything))},
    optional={
        "cron": _mostly(st.sampled_from(["0 3 * * *", "*/5 * * * *"]), _bad_cron),
        "every": _mostly(st.sampled_from([60, 3600]), st.one_of(_number, _anything)),
        "tz": _mostly(st.sampled_from(["UTC", "America/New_York"]), st.one_of(_text, _anything)),
        "params": _mostly(st.just({"a": 1}), st.one_of(_anything, _deep_json)),
        "dst_gap": _mostly(st.just("shift"), st.one_of(_text, _anything)),
        "dst_fold": _mostly(st.just("first"), st.one_of(_text, _anything)),
        "catchup": _mostly(st.sampled_from(["latest", "none", "all"]), st.one_of(_text, _anything)),
        "max_catchup": _mostly(st.sampled_from([1, 10]), st.one_of(_number, _anything)),
        "overlap": _mostly(st.sampled_from(["allow", "skip"]), st.one_of(_text, _anything)),
        "max_active_runs": _mostly(st.sampled_from([None, 1]), st.one_of(_number, _anything)),
        "paused": _mostly(st.sampled_from([None, True]), _anything),
        "spec": _mostly(st.just(_small_spec), st.one_of(_anything, _spec())),
        "dag": _mostly(st.just("tasks.dags:nope"), st.one_of(_text, _anything)),
        "registered": _mostly(st.just("target"), st.one_of(_text, _anything)),
    },
)
_trigger = st.fixed_dictionaries(
    {"name": _mostly(st.sampled_from(["t1", "t2"]), st.one_of(_text, _anything)), "event": _event_key},
    optional={
        "match": _mostly(st.just({"n": 1}), st.one_of(_anything, _deep_json)),
        "params": _mostly(st.just({"a": 1}), st.one_of(_anything, _deep_json)),
        "max_active_runs": _mostly(st.sampled_from([None, 1]), st.one_of(_number, _anything)),
        "paused": _mostly(st.sampled_from([None, False]), _anything),
        "spec": _mostly(st.just(_small_spec), st.one_of(_anything, _spec())),
        "registered": _mostly(st.just("target"), st.one_of(_text, _anything)),
    },
)


def _dumps(doc: Any) -> bytes:
    try:
        return json.dumps(doc, default=repr, allow_nan=True).encode("utf-8", "surrogatepass")
    except RecursionError:
        return b'{"key": "go", "payload": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"


_body = st.one_of(
    st.binary(max_size=200),
    st.sampled_from(
        [
            b"[" * 100_000,
            b"{" * 30_000,
            ('{"key": "go", "payload": ' + "[" * 5000 + "]" * 5000 + "}").encode(),
            ('{"key": "go", "payload": {"a": ' + "{" * 3000 + "}" * 3000 + "}}").encode(),
            b"\xff\xfe",
            b'{"key": "go", "payload": {"n": NaN}}',
            b'{"key": "go", "payload": {"n": 1e999}}',
            b'{"key": "go", "key": "go"}',
            b"",
            b"null",
        ]
    ),
    st.fixed_dictionaries(
        {},
        optional={
            "key": _event_key,
            "payload": _payload,
            "event_id": _mostly(st.none(), st.one_of(_text, _anything)),
            "tenant": _mostly(st.none(), st.one_of(_text, _anything)),
            "extra": st.just(1),
        },
    ).map(_dumps),
)
_query = st.dictionaries(
    st.sampled_from(["tenant", "dag", "state", "limit", "offset", "after", "before", "q", "events", "events_before",
                     "edges_after", "format", "page", "part", "key"]),
    st.one_of(_text, st.sampled_from(["-1", "99999999999999999999", "1e3", "RUNNING", "a.b", "0", "\x00", "%"])),
    max_size=3,
)  # fmt: skip
_op = st.sampled_from(
    ["submit", "submit", "hand-built", "emit", "signal", "answer", "operator", "schedule", "trigger",
     "http-event", "http-event", "http-read", "http-action"]
)  # fmt: skip


# ------------------------------------------------------------------ one input, tried


def _tried(world: World, op: str, data: Any) -> tuple[str, Callable[[], Any], bool]:
    """(what, the call, whether a refusal may leave a ledger row)."""
    orc = world.orc
    rid = lambda v: world.run_id if v == "RUN" else v  # noqa: E731
    if op == "submit":
        spec = data.draw(_spec())
        return "submit", lambda: orc.submit(dag_from_spec(spec)), False
    if op == "hand-built":
        dag = data.draw(_hand_built_wait())
        return "submit(hand-built wait/sensor)", lambda: orc.submit(dag), False
    if op == "emit":
        key, payload = data.draw(_event_key), data.draw(_payload)
        event_id, tenant = data.draw(_mostly(st.none(), _text)), data.draw(_mostly(st.none(), _text))
        return "emit", lambda: orc.events.emit(key, payload, event_id=event_id, tenant=tenant), False
    if op == "signal":
        run, name, payload = data.draw(_run_id), data.draw(_event_key), data.draw(_payload)
        event_id = data.draw(_mostly(st.none(), _text))
        return "signal", lambda: orc.events.signal(rid(run), name, payload, event_id=event_id), False
    if op == "answer":
        run, key = data.draw(_run_id), data.draw(_key)
        comment = data.draw(_mostly(st.none(), st.one_of(_text, _anything, st.just("c" * 100_000))))
        fn = orc.approve if data.draw(st.booleans()) else orc.reject
        return "approve/reject", lambda: fn(rid(run), key, comment=comment), True
    if op == "operator":
        run, key = data.draw(_run_id), data.draw(_key)
        action = data.draw(st.sampled_from(["retry", "skip", "fail", "clear", "mark", "cancel", "rerun"]))
        state = data.draw(_mostly(st.sampled_from(["success", "failed", "skipped"]), st.one_of(_text, _anything)))
        calls: dict[str, Callable[[], Any]] = {
            "retry": lambda: orc.retry_task(rid(run), key),
            "skip": lambda: orc.skip_task(rid(run), key),
            "fail": lambda: orc.fail_task(rid(run), key),
            "clear": lambda: orc.clear(rid(run), key, downstream=True),
            "mark": lambda: orc.mark(rid(run), key, state),
            "cancel": lambda: orc.cancel(rid(run)) if run != "RUN" else None,  # the target run stays open
            "rerun": lambda: orc.rerun(rid(run)),
        }
        return f"operator {action}", calls[action], True
    if op == "schedule":
        fields = dict(data.draw(_schedule))
        name = fields.pop("name")
        return "schedules.add", lambda: orc.schedules.add(name, **fields), False
    if op == "trigger":
        fields = dict(data.draw(_trigger))
        name, event = fields.pop("name"), fields.pop("event")
        return "triggers.add", lambda: orc.triggers.add(name, event=event, **fields), False
    if op == "http-event":
        body = data.draw(_body)
        return "POST /api/events", lambda: world.http("POST", "/api/events", body), False
    if op == "http-read":
        from urllib.parse import quote, urlencode

        run = data.draw(_run_id)
        path = data.draw(st.sampled_from(["/api/runs", "/api/runs/{}", "/api/runs/{}/changes", "/api/runs/{}/graph"]))
        run_text = quote(str(rid(run)), safe="", errors="surrogatepass")
        target = path.format(run_text) + "?" + urlencode(data.draw(_query), errors="surrogatepass")
        return "GET " + path, lambda: world.http("GET", target), False
    from urllib.parse import quote, urlencode

    run, key = data.draw(_run_id), data.draw(_key)
    action = data.draw(
        st.sampled_from(["retry", "skip", "fail", "clear", "mark", "approve", "reject", "cancel", "rerun"])
    )
    form = urlencode(
        data.draw(
            st.dictionaries(st.sampled_from(["downstream", "state", "comment"]), _text | st.just("1"), max_size=2)
        ),
        errors="surrogatepass",
    ).encode()
    run_text = quote(str(rid(run)), safe="", errors="surrogatepass")
    if action in ("cancel", "rerun"):
        if run == "RUN" and action == "cancel":
            run_text = "nosuchrun"
        path = f"/api/runs/{run_text}/{action}"
    else:
        path = f"/api/runs/{run_text}/tasks/{quote(str(key), safe='', errors='surrogatepass')}/{action}"
    return f"POST /api/.../{action}", lambda: world.http("POST", path, form, "application/x-www-form-urlencoded"), True


#: how the inputs of this session ended (printed by the long run: pytest -m fuzz -s)
OUTCOMES: Counter[str] = Counter()


def _run(world: World, n: int) -> list[str]:
    """Try ``n`` inputs; the raw exceptions and partial writes found, one line each (at most
    three of each kind)."""
    found: list[str] = []
    kinds: Counter[str] = Counter()

    @settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(_op, st.data())
    def prop(op: str, data: Any) -> None:
        what, call, ledger_ok = _tried(world, op, data)
        before = counts(world.orc)
        try:
            call()
        except OrchestratorError as exc:
            if isinstance(exc, ConfigurationError):
                kind = f"{what}: ConfigurationError"
            else:
                OUTCOMES["refused"] += 1
                after = counts(world.orc)
                changed = {t: after[t] - before[t] for t in after if after[t] != before[t]}
                if ledger_ok:
                    changed = {t: d for t, d in changed.items() if t not in LEDGER}
                if not changed:
                    return
                kind = f"{what}: a refusal wrote rows {changed} ({type(exc).__name__}: {str(exc)[:120]})"
        except AssertionError as exc:  # an HTTP 5xx, or a 4xx without its JSON error
            kind = f"{what}: {str(exc)[:200]}"
        except Exception as exc:  # noqa: BLE001 - a raw exception is what this looks for
            tb = traceback.extract_tb(exc.__traceback__)[-1]
            kind = f"{what}: {type(exc).__name__} at {os.path.basename(tb.filename)}:{tb.lineno}: {str(exc)[:120]}"
        else:
            OUTCOMES["accepted"] += 1
            return
        OUTCOMES["raw"] += 1
        key = kind.split(":")[0] + kind.split(" at ")[-1].split(":")[0] if " at " in kind else kind[:80]
        kinds[key] += 1
        if kinds[key] <= 3:
            found.append(kind)
            print(f"\n  found: {kind}", flush=True)  # a long run shows it at once

    prop()
    return found


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    settings_ = Settings.from_env(
        {}, data_dir=str(tmp_path_factory.mktemp("api-fuzz")), database_url=clean_test_database()
    )
    orc = Orchestrator(settings_, publisher=RecordingPublisher(), registry=StaticRegistry(TASKS))
    logging.getLogger("tornado.access").setLevel(logging.ERROR)  # 4xx lines by the thousand
    w = World(orc)
    yield w
    w.stop()
    orc.store.dispose()


#: 20,000 deep: 40 KB, within the server's 64 KiB body limit
DEEP = "[" * 20_000 + "]" * 20_000


@pytest.mark.parametrize(
    "body",
    [
        DEEP.encode(),
        ('{"key": "go", "payload": {"a": ' + DEEP + "}}").encode(),
        ('{"key": "go", "payload": {"a": ' + "{" * 3000 + "}" * 3000 + "}}").encode(),
        b"\xff\xfe{}",
    ],
    ids=["deep", "deep-payload", "deep-object", "not-utf8"],
)
def test_a_body_nested_too_deep_or_not_utf8_is_a_400(world: World, body: bytes) -> None:
    """``POST /api/events`` with JSON nested 20,000 deep answered 500 (a RecursionError)."""
    assert world.http("POST", "/api/events", body) == 400


def test_an_unknown_address_under_api_answers_json(world: World) -> None:
    assert world.http("POST", f"/api/runs/{world.run_id}/tasks/a%20b/retry", b"") == 404  # JSON checked
    assert world.http("GET", "/api/nope") == 404


def _nested(depth: int) -> dict[str, Any]:
    inner: dict[str, Any] = {}
    for _ in range(depth):
        inner = {"a": inner}
    return inner


#: a valid spec for the calls whose other input is the bad one
SPEC = {"name": "fuzz-ok", "tasks": [{"key": "a", "task": "tasks.probes.noop"}]}


@pytest.mark.parametrize(
    "call",
    [
        lambda orc, run: orc.approve(run + "\x00", "ok"),
        lambda orc, run: orc.reject("\ud800", "ok"),
        lambda orc, run: orc.retry_task(run, "a\x00"),
        lambda orc, run: orc.fail_task("\ud800", "a"),
        lambda orc, run: orc.events.signal("\x00", "go"),
        lambda orc, run: orc.rerun("\ud800"),  # found by the long run: a read outside the store's retry wrapper
        lambda orc, run: orc.rerun("a\x00"),
        lambda orc, run: orc.triggers.add("t1", event="go", spec=[1]),
        lambda orc, run: orc.schedules.add("s1", every=3600, spec=[1]),
        # found by the 100,000-input run: params nested past the JSON encoder's recursion limit
        lambda orc, run: orc.triggers.add("t1", event="go", spec=SPEC, params={"p": _nested(5000)}),
        lambda orc, run: orc.schedules.add("s1", every=3600, spec=SPEC, params={"p": _nested(5000)}),
    ],
    ids=["approve-nul", "reject-surrogate", "retry-nul-key", "fail-surrogate", "signal-nul", "rerun-surrogate",
         "rerun-nul", "trigger-spec-list", "schedule-spec-list", "trigger-params-deep", "schedule-params-deep"],
)  # fmt: skip
def test_known_bad_python_inputs_are_typed_refusals(world: World, call: Any) -> None:
    """Inputs the first fuzz runs found ending in a raw psycopg DataError, a UnicodeEncodeError
    or a TypeError of pathlib; refused now with a typed error, nothing written."""
    before = counts(world.orc)
    with pytest.raises(OrchestratorError) as caught:
        call(world.orc, world.run_id)
    assert not isinstance(caught.value, ConfigurationError) and str(caught.value)
    assert counts(world.orc) == before


def test_api_inputs_are_accepted_or_refused_with_a_typed_error(world: World) -> None:
    OUTCOMES.clear()
    found = _run(world, _budget(False))
    assert not found, "raw exceptions or partial writes:\n" + "\n".join(found)


#: inputs between two resets of the long run's database
CHUNK = 5000


@pytest.mark.fuzz
@pytest.mark.timeout(4 * 3600)
def test_fuzz_the_api_long(world: World) -> None:
    OUTCOMES.clear()
    n = _budget(True)
    found: list[str] = []
    for start in range(0, n, CHUNK):
        if start:
            world.reset()
        found += _run(world, min(CHUNK, n - start))
        print(f"\n  {start + min(CHUNK, n - start)} inputs: {dict(OUTCOMES)}", flush=True)
    print(
        f"\nAPI fuzz: {sum(OUTCOMES.values())} inputs ({n} asked): {OUTCOMES['accepted']} accepted,"
        f" {OUTCOMES['refused']} refused with a typed error, {OUTCOMES['raw']} raw exceptions or partial writes"
    )
    assert not found, "raw exceptions or partial writes:\n" + "\n".join(found)
