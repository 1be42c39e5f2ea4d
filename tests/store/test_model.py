"""A model-based test of the store (issue 36): a Hypothesis state machine over the real server
functions, no worker processes.

The deployment is the test kit's (:class:`orchestrator.testing.Kit`): an orchestrator on the
kit's database with its virtual clock, an in-process broker (``InProcessPublisher``: what was
published, what was revoked) and the production transitions. The machine plays every actor
itself, one step at a time, in any order Hypothesis draws: it submits DAGs with maps (chained
too), a branch, a short circuit, a wait on an event, an approval, setup and teardown tasks and
retries; a worker takes a message (a revoked one is dropped, as Celery drops it), claims,
succeeds, fails, skips, defers, loses its lease, delivers a duplicate or a late result; the
broker loses a message; an operator clears (with and without downstream), marks, retries,
skips, fails, cancels and reruns; an event is emitted; an approval answered; the reconciler
makes a pass; the clock moves.

After every step (``@invariant``): :func:`orchestrator.services.invariants.check_runs` (one accepted
outcome per task generation, legal transitions only, maps consistent; runs in progress
allowed), the counters equal a recount from the rows, no open task whose current message was
revoked, and every open run has a next step some actor will take (``tests/store/model.py``).

The default run draws ``EXAMPLES`` examples of at most ``STEPS`` steps, the same ones every run
(derandomized: a landing is never blocked by a lucky draw); the long run sits behind
the ``soak`` marker (``ORCHESTRATOR_MODEL_EXAMPLES`` / ``ORCHESTRATOR_MODEL_STEPS`` size it;
docs/operations.md, "Tests").
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from orchestrator import DAG, Defer
from orchestrator.core.errors import OperatorError, RunNotFound, TaskNotFound
from orchestrator.core.models import Dispatch
from orchestrator.services.invariants import check_runs
from orchestrator.testing import Kit, KitDatabase
from orchestrator.testing.app import kit_settings
from orchestrator.testing.runner import WORKER
from tests.store import model

pytestmark = pytest.mark.postgres

#: the default run: examples, and steps at most per example
EXAMPLES, STEPS = 15, 30
NOOP = "tasks.probes.noop"
EVENT = "model.go"
RULES = ["all_success", "all_done", "one_success", "none_failed", "all_failed", "none_failed_min_one_success"]
#: what an operator's action may be refused with (a ledger row says so); anything else fails
REFUSED = (OperatorError, RunNotFound, TaskNotFound)
#: what the examples did (printed at the end: the rules taken, their outcomes, the states seen)
TALLY: Counter[str] = Counter()


@dataclass(frozen=True)
class Shape:
    """Which features a submitted DAG has (drawn)."""

    setup: bool
    mapped: bool
    chained: bool
    max_active: int | None
    branch: bool
    short_circuit: bool
    wait: bool
    approval: bool
    join_rule: str
    max_attempts: int


shapes = st.builds(
    Shape,
    setup=st.booleans(),
    mapped=st.booleans(),
    chained=st.booleans(),
    max_active=st.sampled_from([None, 1]),
    branch=st.booleans(),
    short_circuit=st.booleans(),
    wait=st.booleans(),
    approval=st.booleans(),
    join_rule=st.sampled_from(RULES),
    max_attempts=st.integers(1, 3),
)


def build(name: str, shape: Shape) -> DAG:
    """src -> [m -> m2] -> join; src -> br -> left | right; sc -> after_sc; src -> w -> after_w;
    ap; setup before src and a teardown after join (each as the shape says)."""
    dag = DAG(name)
    retry: dict[str, Any] = {
        "max_attempts": shape.max_attempts,
        "backoff": {"base": 1000, "cap": 2000, "jitter": "none"},
    }
    setup = [dag.task("setup", NOOP, setup=True)] if shape.setup else []
    src = dag.task("src", NOOP, upstream=setup, **retry)
    last = src
    if shape.mapped:
        last = dag.map("m", NOOP, over=src, kwarg="x", max_active=shape.max_active, **retry)
        if shape.chained:
            last = dag.map("m2", NOOP, over=last, kwarg="y")
    join = dag.task("join", NOOP, upstream=[last], trigger_rule=shape.join_rule)
    if shape.branch:
        br = dag.task("br", NOOP, upstream=[src], branch=True)
        dag.task("left", NOOP, upstream=[br])
        dag.task("right", NOOP, upstream=[br])
    if shape.short_circuit:
        sc = dag.task("sc", NOOP, short_circuit=True)
        dag.task("after_sc", NOOP, upstream=[sc])
    if shape.wait:
        w = dag.wait("w", event=EVENT, timeout=6000, upstream=[src])
        dag.task("after_w", NOOP, upstream=[w])
    if shape.approval:
        dag.approval("ap", timeout=36000)
    if shape.setup:
        dag.task("teardown", NOOP, upstream=[*setup, join], teardown=True)
    return dag


@dataclass
class Held:
    """A claimed attempt: the message and whether its worker still lives."""

    d: Dispatch


class StoreModel(RuleBasedStateMachine):
    db: KitDatabase  # set by the test

    def __init__(self) -> None:
        super().__init__()
        TALLY["examples"] += 1
        self.db.clean()
        # every duration (leases, the dispatch timeout, backoff, waits) far longer than an example
        # takes on a loaded machine: only the drawn clock moves decide them (an example replays
        # the same; with 30 s, real time released a retry and a replay went another way)
        settings = replace(kit_settings(self.db.url), lease_seconds=3000, dispatch_timeout=1200)
        self.kit = Kit(self.db, settings=settings)
        self.orc = self.kit.orc
        self.pub = self.kit.publisher
        self.dags: dict[str, DAG] = {}
        self.running: list[Held] = []
        #: attempts whose worker lost them (killed, paused): their lease runs out, a late result may come
        self.zombies: list[Held] = []

    def teardown(self) -> None:
        self.kit.close()

    # -------------------------------------------------------------- helpers

    # What is drawn depends only on what was drawn before, never on the database (run ids are
    # random, map children come and go): Hypothesis replays and shrinks a failing example.

    def _run(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(list(self.dags)), label="run")

    def _key(self, data: st.DataObject, run_id: str) -> str:
        """A node of the run's DAG, or a map child that may exist (else the action is refused)."""
        dag = self.dags[run_id]
        keys = list(dag.nodes) + [f"{k}[{i}]" for k in dag.nodes if dag.nodes[k].map is not None for i in range(3)]
        return data.draw(st.sampled_from(keys), label="key")

    def _order(self, d: Dispatch) -> tuple[int, str, int]:
        """A message's place in a deterministic order: by run (as submitted), key, attempt. The
        broker's order is the database's, and rows made READY in one transaction tie."""
        return (list(self.dags).index(d.run_id), d.key, d.attempt)

    def _pop(self, i: int) -> Dispatch:
        """Take the ``i``-th message (in :meth:`_order`) out of the broker."""
        d = sorted(self.pub.queue, key=self._order)[i]
        self.pub.queue.remove(d)
        return d

    def _result(self, data: st.DataObject, d: Dispatch) -> Any:
        """What the body of ``d`` returns: a list for a map's source, a child to follow for a
        branch, truthy or falsy for a short circuit, else a small value."""
        dag = self.dags[d.run_id]
        node = dag.nodes.get(d.key.split("[", 1)[0])
        if node is None:
            return None
        if any(n.map is not None and any(a.source == node.key for a in n.map.args) for n in dag.nodes.values()):
            if node.map is None:
                return data.draw(st.lists(st.integers(0, 9), max_size=3), label="items")
        if node.branch:
            return data.draw(st.sampled_from(["left", "right", ["left", "right"], []]), label="follow")
        if node.short_circuit:
            return data.draw(st.sampled_from([True, 1, 0, None]), label="short")
        return d.key

    def _operator(self, action: Any, *args: Any, **kwargs: Any) -> Any:
        name = getattr(action, "__name__", "operator")
        try:
            done = action(*args, by="model", **kwargs)
        except REFUSED:
            TALLY[f"{name} refused"] += 1
            return None
        TALLY[f"{name} done"] += 1
        return done

    # -------------------------------------------------------------- submit

    @precondition(lambda self: len(self.dags) < 3)
    @rule(shape=shapes)
    def submit(self, shape: Shape) -> None:
        dag = build(f"model-{len(self.dags)}", shape)
        self.dags[self.kit.submit(dag).id] = dag

    @precondition(lambda self: self.dags and len(self.dags) < 4)
    @rule(data=st.data())
    def rerun(self, data: st.DataObject) -> None:
        source = self._run(data)
        handle = self.orc.rerun(source)
        self.dags[handle.id] = self.dags[source]

    # -------------------------------------------------------------- the broker and the worker

    @precondition(lambda self: self.pub.queue)
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        """A worker takes a message: dropped when revoked, else claimed (a refused claim is a
        duplicate or a stale attempt: dropped, recorded)."""
        d = self._pop(data.draw(st.integers(0, len(self.pub.queue) - 1), label="message"))
        if d.token.task_id in self.pub.revoked:
            TALLY["deliver: revoked, dropped"] += 1
            return
        if self.orc.claim(d.token, WORKER, d.task_name) is not None:
            TALLY["deliver: claimed"] += 1
            self.running.append(Held(d))
        else:
            TALLY["deliver: claim refused"] += 1

    @precondition(lambda self: self.pub.queue)
    @rule(data=st.data(), n=st.integers(1, 8))
    def work(self, data: st.DataObject, n: int) -> None:
        """A worker takes the next ``n`` messages in order and runs each to its end (most succeed)."""
        for _ in range(n):
            if not self.pub.queue:
                return
            d = self._pop(0)
            if d.token.task_id in self.pub.revoked:
                TALLY["work: revoked, dropped"] += 1
                continue
            if self.orc.claim(d.token, WORKER, d.task_name) is None:
                TALLY["work: claim refused"] += 1
                continue
            self._finish(data, Held(d), late=False, mostly=True)

    @precondition(lambda self: self.pub.queue)
    @rule(data=st.data(), n=st.integers(1, 8))
    def work_more(self, data: st.DataObject, n: int) -> None:
        """:meth:`work` again: drawn twice as often as another rule, the runs get somewhere."""
        self.work(data, n)

    @precondition(lambda self: self.pub.queue)
    @rule(data=st.data())
    def lose_message(self, data: st.DataObject) -> None:
        """The broker loses a message (a flush, a restart)."""
        self._pop(data.draw(st.integers(0, len(self.pub.queue) - 1), label="message"))

    @precondition(lambda self: self.pub.sent)
    @rule(data=st.data())
    def duplicate(self, data: st.DataObject) -> None:
        """A message delivered again (a redelivery, a double publish), any one ever sent."""
        self.pub.queue.append(data.draw(st.sampled_from(sorted(self.pub.sent, key=self._order)), label="copy"))

    def _take(self, data: st.DataObject, late: bool) -> Held:
        pool = self.zombies if late else self.running
        return pool.pop(data.draw(st.integers(0, len(pool) - 1), label="attempt"))

    def _finish(self, data: st.DataObject, held: Held, late: bool, mostly: bool = False) -> None:
        d = held.d
        ways = ["succeed", "succeed", "fail", "fail_final", "skip", "defer"]
        how = data.draw(st.sampled_from(ways + ["succeed"] * 6 if mostly else ways), label="how")
        if how == "succeed":
            accepted = self.orc.complete(d.token, self._result(data, d)).accepted
        elif how in ("fail", "fail_final"):
            accepted = self.orc.fail_attempt(d.token, error="RuntimeError: model", retryable=how == "fail").accepted
        elif how == "skip":
            accepted = self.orc.skip_attempt(d.token, "model").accepted
        else:
            delay = data.draw(st.sampled_from([None, 1500.0]), label="delay")
            spec = Defer(event=None if delay else EVENT, delay=delay, timeout=3000).spec()
            accepted = self.orc.defer_attempt(d.token, spec)
        TALLY[f"{'late ' if late else ''}{how} {'accepted' if accepted else 'refused'}"] += 1

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """A body ends: succeeds, fails (retryable or not), skips or defers."""
        self._finish(data, self._take(data, late=False), late=False)

    @precondition(lambda self: self.zombies)
    @rule(data=st.data())
    def late_result(self, data: st.DataObject) -> None:
        """A worker that lost its attempt (paused past its lease, or fenced) reports anyway."""
        self._finish(data, self._take(data, late=True), late=True)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def lose_worker(self, data: st.DataObject) -> None:
        """The worker running an attempt dies or pauses: no heartbeat, no result (for now)."""
        self.zombies.append(self._take(data, late=False))

    @precondition(lambda self: self.running)
    @rule()
    def heartbeat(self) -> None:
        """The live workers extend their leases (a fenced one learns it lost its attempt)."""
        for held in list(self.running):
            if not self.orc.heartbeat(held.d.token):
                self.running.remove(held)
                self.zombies.append(held)

    # -------------------------------------------------------------- time and the reconciler

    @rule()
    def reconcile(self) -> None:
        for what, n in self.kit.reconcile().items():
            TALLY[f"reconciler: {what}"] += n

    @rule(seconds=st.sampled_from([1001.0, 1300.0, 3100.0, 7000.0, 40000.0]))
    def advance(self, seconds: float) -> None:
        self.kit.clock.advance(seconds)

    # -------------------------------------------------------------- events and people

    @precondition(lambda self: self.dags)
    @rule(data=st.data())
    def emit(self, data: st.DataObject) -> None:
        if data.draw(st.booleans(), label="as signal"):
            self.orc.events.signal(self._run(data), EVENT, {"n": 1})
        else:
            self.orc.events.emit(EVENT, {"n": 1})

    @precondition(lambda self: self.dags)
    @rule(data=st.data(), yes=st.booleans())
    def answer(self, data: st.DataObject, yes: bool) -> None:
        run_id = self._run(data)
        if "ap" in self.dags[run_id].nodes:
            self._operator(self.orc.approve if yes else self.orc.reject, run_id, "ap")

    # -------------------------------------------------------------- the operator

    @precondition(lambda self: self.dags)
    @rule(data=st.data(), downstream=st.booleans())
    def clear(self, data: st.DataObject, downstream: bool) -> None:
        run_id = self._run(data)
        self._operator(self.orc.clear, run_id, self._key(data, run_id), downstream=downstream)

    @precondition(lambda self: self.dags)
    @rule(data=st.data(), key=st.sampled_from(["src", "m", "br"]), downstream=st.booleans())
    def clear_a_source(self, data: st.DataObject, key: str, downstream: bool) -> None:
        """A clear of a map's source, a map or a branch (where clears meet expansions and
        choices: drawn as often as a clear of any other task)."""
        self._operator(self.orc.clear, self._run(data), key, downstream=downstream)

    @precondition(lambda self: self.dags)
    @rule(data=st.data(), state=st.sampled_from(["success", "fail", "skip"]))
    def mark(self, data: st.DataObject, state: str) -> None:
        run_id = self._run(data)
        self._operator(self.orc.mark, run_id, self._key(data, run_id), state)

    @precondition(lambda self: self.dags)
    @rule(data=st.data(), action=st.sampled_from(["retry", "skip", "fail", "retry", "skip", "cancel"]))
    def resolve(self, data: st.DataObject, action: str) -> None:
        """An operator's retry (FAILED, DEAD_LETTER), skip or give-up (DEAD_LETTER), or a cancel
        of the run (one draw in six: a cancelled run has little left to find)."""
        run_id = self._run(data)
        if action == "cancel":
            self._operator(self.orc.cancel, run_id)
            return
        act = {"retry": self.orc.retry_task, "skip": self.orc.skip_task, "fail": self.orc.fail_task}[action]
        self._operator(act, run_id, self._key(data, run_id))

    # -------------------------------------------------------------- after every step

    @invariant()
    def promise_kept(self) -> None:
        if not self.dags:
            return
        ids = sorted(self.dags)
        problems = check_runs(self.orc.store, ids, allow_dead_letter=True, in_progress_ok=True)
        tasks, edges, runs = model.rows(self.db.engine, ids)
        TALLY["steps checked"] += 1
        TALLY.update(f"task state seen: {x.state}" for x in tasks)
        TALLY.update(f"run state seen: {r.state}" for r in runs)
        problems += model.counter_problems(tasks, edges, runs)
        problems += model.revoked_problems(tasks, self.pub)
        problems += model.progress_problems(tasks, edges, runs)
        assert problems == [], "\n".join(problems)


@pytest.fixture
def model_db(orchestrator_db: KitDatabase) -> Iterator[KitDatabase]:
    StoreModel.db = orchestrator_db
    yield orchestrator_db


def _run(examples: int, steps: int, *, derandomize: bool) -> None:
    TALLY.clear()
    TALLY["examples"] = 0
    started = time.monotonic()
    run_state_machine_as_test(
        StoreModel,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            derandomize=derandomize,
            suppress_health_check=list(HealthCheck),
        ),
    )
    print(f"\nmodel: {TALLY['examples']} examples, {TALLY['steps checked']} steps checked,"
          f" {time.monotonic() - started:.1f} s")  # fmt: skip
    for what, n in sorted(TALLY.items()):
        print(f"  {what}: {n}")


def test_the_store_keeps_its_promise_whatever_the_actors_do(model_db: KitDatabase) -> None:
    # the same examples every run (a landing is never blocked by a draw): the soak explores
    _run(EXAMPLES, STEPS, derandomize=True)


@pytest.mark.soak
@pytest.mark.timeout(0)
def test_the_store_keeps_its_promise_long(model_db: KitDatabase) -> None:
    _run(
        int(os.environ.get("ORCHESTRATOR_MODEL_EXAMPLES", "1000")),
        int(os.environ.get("ORCHESTRATOR_MODEL_STEPS", "80")),
        derandomize=False,
    )
