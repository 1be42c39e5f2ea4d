"""The chaos soak's workload: the random DAGs it submits (plain, mapped, branching, skipping,
waiting on events and instants) over the probe tasks, and the events it emits for them; the
operator's action mix lives beside it (:mod:`.mix`)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from ...core.dag import DAG
from .deployment import (  # noqa: F401
    DEFAULT_MODULES,
    LACKED_MODULE,
    LACKING,
    LIBFAKETIME,
    ROOT,
    SKEWED,
    SLEEP_SHIM,
    Deployment,
    PrivatePostgres,
    Relay,
    Relays,
    free_port,
    libfaketime,
    skewed_env,
    stop_group,
)

#: ``--mix``: the resource whose circuit breaker the actions open and close
RESOURCE = "chaos-res"
#: the retry options of every soak task: a fault costs an attempt, never the run
RETRY: dict[str, Any] = {"max_attempts": 10, "backoff": {"base": 0.2, "cap": 1.0}}
#: the shapes a soak DAG takes beyond its plain probe nodes (``plain``: none)
SHAPES = ("plain", "map", "branch", "skip")
#: the share of soak DAGs that also wait (events, a sleep, a deferred body, a sensor)
WAITING_SHARE = 0.4

P = "tasks.probes."

D = "tasks.dynamic."


def random_dag(rng: random.Random, i: int, mixed: bool = False) -> DAG:
    """A random DAG of 2-10 probe tasks (``sleep``, ``flaky``, ``echo``, ``noop``) that may grow,
    below them, a map over a listing's result (sometimes chained, bounded by max_active, empty,
    with children that skip themselves; joined under a random trigger rule), a branch, or tasks
    that skip (``orchestrator.Skip``, a short circuit) with children of several rules."""
    dag = DAG(f"chaos-{i}", tenant=rng.choice(["acme", "globex", "initech"]))
    keys: list[str] = []
    for n in range(rng.randint(2, 10)):
        ups = rng.sample(keys, k=min(len(keys), rng.randint(0, 2))) if keys else []
        kind = rng.random()
        if kind < 0.35:
            dag.task(f"n{n}", P + "sleep", kwargs={"seconds": round(rng.uniform(0.05, 0.6), 2)}, upstream=ups,
                     **RETRY)  # fmt: skip
        elif kind < 0.5:
            dag.task(f"n{n}", P + "flaky", kwargs={"fail_times": rng.randint(1, 2)}, upstream=ups, **RETRY)
        else:
            dag.task(f"n{n}", P + ("echo" if kind < 0.75 else "noop"), upstream=ups, **RETRY)
        keys.append(f"n{n}")
    shape = rng.choice(SHAPES)
    above = rng.sample(keys, k=rng.randint(0, 1))
    if shape == "map":
        _mapped(dag, rng, above)
    elif shape == "branch":
        _branching(dag, rng, above)
    elif shape == "skip":
        _skipping(dag, rng, above)
    if rng.random() < WAITING_SHARE:
        _waiting(dag, rng, rng.sample(keys, k=rng.randint(0, 1)), i)
    if mixed:
        _mixed(dag, random.Random(f"mix-{i}-{rng.random()}"), keys)
    return dag


def _mixed(dag: DAG, rng: random.Random, keys: list[str]) -> None:
    """``--mix``'s extra nodes: an approval (``ok``: the soak answers it) with a child, and a
    task using the resource whose breaker the soak opens and closes."""
    if rng.random() < 0.3:
        ok = dag.approval("ok", upstream=rng.sample(keys, k=rng.randint(0, 1)))
        dag.task("approved", P + "echo", upstream=[ok], trigger_rule="all_done", **RETRY)
    if rng.random() < 0.3:
        dag.task("res", P + "echo", resources=[RESOURCE], upstream=rng.sample(keys, k=rng.randint(0, 1)), **RETRY)


def _mapped(dag: DAG, rng: random.Random, above: list[str]) -> None:
    """ls -> m (one child per item of ls's result) [-> m2, item by item] -> join."""
    n = rng.choice([0, 1, 3, 8, 20, 30])
    ls = dag.task("ls", D + "listing", kwargs={"n": n, "seconds": round(rng.uniform(0.0, 0.3), 2)}, upstream=above,
                  **RETRY)  # fmt: skip
    item = {"seconds": round(rng.uniform(0.0, 0.2), 2), "skip_every": rng.choice([0, 0, 0, 4])}
    m = dag.map("m", D + "item", over=ls, kwarg="x", kwargs=item, on_empty=rng.choice(["skip", "success"]),
                max_active=rng.choice([None, None, 3]), **RETRY)  # fmt: skip
    last = m
    if rng.random() < 0.4:  # a chained map: each item's second stage as soon as its first is done
        last = dag.map("m2", D + "item", over=m, kwarg="x", kwargs={"add": 1}, **RETRY)
    rule = rng.choice(["all_success", "all_done", "none_failed", "one_success", "none_failed_min_one_success"])
    ratio = 0.5 if rule == "all_success" and rng.random() < 0.5 else None
    dag.task("join", D + "collect", upstream=[last], trigger_rule=rule, min_success_ratio=ratio, **RETRY)


def _branching(dag: DAG, rng: random.Random, above: list[str]) -> None:
    """pick (a branch) -> a / b / c, d below b; the paths joined by none_failed_min_one_success."""
    paths = ["a", "b", "c"]
    chosen = rng.sample(paths, k=rng.randint(1, 2))
    pick = dag.task("pick", D + "choose", kwargs={"pick": chosen if len(chosen) > 1 else chosen[0]},
                    upstream=above, branch=True, **RETRY)  # fmt: skip
    a = dag.task("a", P + "sleep", kwargs={"seconds": round(rng.uniform(0.05, 0.4), 2)}, upstream=[pick], **RETRY)
    b = dag.task("b", P + "echo", upstream=[pick], **RETRY)
    c = dag.task("c", P + "flaky", kwargs={"fail_times": 1}, upstream=[pick], **RETRY)
    d = dag.task("d", P + "noop", upstream=[b], **RETRY)
    dag.task("paths", P + "echo", upstream=[a, c, d], trigger_rule="none_failed_min_one_success", **RETRY)


def _skipping(dag: DAG, rng: random.Random, above: list[str]) -> None:
    """A task that raises Skip and a short circuit (a falsy result), each with children of several rules."""
    s = dag.task("s", D + "skip", kwargs={"reason": "nothing new"}, upstream=above, **RETRY)
    dag.task("s_strict", P + "noop", upstream=[s], **RETRY)  # SKIPPED: upstream_skipped
    dag.task("s_tolerant", P + "echo", upstream=[s], trigger_rule="none_failed", **RETRY)
    dag.task("s_all_skipped", P + "noop", upstream=[s], trigger_rule="all_skipped", **RETRY)
    gate = dag.task("gate", D + "item", kwargs={"x": rng.choice([0, 1])}, short_circuit=True, **RETRY)
    after = dag.task("gated", P + "sleep", kwargs={"seconds": 0.1}, upstream=[gate], **RETRY)
    dag.task("gated_after", P + "noop", upstream=[after], **RETRY)


def _waiting(dag: DAG, rng: random.Random, above: list[str], i: int) -> None:
    """ev (an event wait with a match), nap (a short sleep), df (a body deferring until its
    event, with a saved state), sometimes a sensor; ``woken`` below them (their results)."""
    ev = dag.wait("ev", event=f"chaos.{i}", match={"i": i}, upstream=above)
    nap = dag.wait("nap", delay=round(rng.uniform(0.1, 2.0), 2), upstream=above)
    df = dag.task("df", P + "deferring", kwargs={"event": f"chaos.{i}.resume", "match": {"i": i}, "state": {"i": i},
                  "seconds": round(rng.uniform(0.0, 0.3), 2)}, upstream=above, **RETRY)  # fmt: skip
    waits = [ev, nap, df]
    if rng.random() < 0.5:
        # (a sensor's backoff is its interval's factor: its retries back off by the default)
        waits.append(dag.sensor("sense", P + "not_yet", kwargs={"times": rng.randint(0, 2)}, every=0.3,
                                backoff=1.5, upstream=above, max_attempts=RETRY["max_attempts"]))  # fmt: skip
    dag.task("woken", P + "echo", upstream=waits, **RETRY)


@dataclass(frozen=True)
class Emit:
    """An event the soak emits for a waiting DAG (``event_id`` makes a retry a duplicate)."""

    key: str
    payload: dict[str, Any]
    tenant: str
    event_id: str


def emits_for(dag: DAG, event_id: str) -> list[Emit]:
    """The events that wake ``dag``'s event waits and deferred bodies (each payload its match
    and more), plus a decoy per key that matches none of them."""
    out: list[Emit] = []
    for node in dag.nodes.values():
        if node.wait is not None and node.wait.kind == "event" and node.wait.event is not None:
            key, match = node.wait.event, dict(node.wait.match or {})
        elif node.task == P + "deferring":
            key, match = str(node.kwargs["event"]), dict(node.kwargs.get("match") or {})
        else:
            continue
        out.append(Emit(key, {**match, "from": "chaos"}, dag.tenant, f"{event_id}-{node.key}"))
        out.append(Emit(key, {"i": -1, "decoy": True}, dag.tenant, f"{event_id}-{node.key}-decoy"))
    return out
