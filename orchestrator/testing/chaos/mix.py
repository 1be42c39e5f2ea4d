"""``orchestrator chaos --mix``: what users do to the soak's runs while the faults go on.

The :class:`Mixer` deals operator actions from a shuffled deck (every kind once per round), one
at a time at random moments, through the public API (:class:`~orchestrator.Orchestrator`):

- ``clear`` and ``clear_downstream`` (``clear(..., downstream=True)``) of a map's source, a
  map's child, a branch or any other task; ``mark`` (SUCCEEDED, FAILED or SKIPPED);
  ``retry`` (of a FAILED or parked task when there is one); ``skip`` (of a parked one);
  ``cancel`` of an open run; ``rerun`` (a new run of the same snapshot, followed like the rest).

Each action is recorded with its outcome: ``applied``, ``refused`` (a typed refusal the API
documents: the state did not allow it, or it lost a race) or ``error`` (anything else: a fault
hit it, or a bug). The runs each action touched are kept, so a violation the final check finds
in a run is reported under every action kind that touched it (:meth:`Mixer.blame`).
"""

from __future__ import annotations

import random
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from ...core.dag import DAG
from ...core.errors import OperatorError, RunNotFound, TaskNotFound, ValidationError
from ...core.routing import DEFAULT_TENANT
from ...core.states import TaskState
from ...core.waits import WAIT_TASK
from ...engine.facade import Orchestrator

#: every kind of operator action, once per round of the deck
ACTIONS = ["clear", "clear_downstream", "mark", "retry", "skip", "cancel", "rerun", "approve", "foreign_emit",
           "breaker", "schedule", "trigger", "db_clean"]  # fmt: skip
#: the event that starts a run through the soak's trigger
TRIGGER_EVENT = "chaos.trigger"
#: the tenants of the soak's runs (a foreign emit comes from another one)
TENANTS = ("acme", "globex", "initech")
#: the typed refusals of the operator API: the action was not allowed, nothing went wrong
REFUSALS = (OperatorError, RunNotFound, TaskNotFound, ValidationError)
_RUN_ID = re.compile(r"\b[0-9a-f]{32}\b")


@dataclass
class Tally:
    """One action kind's outcomes; ``targets``: what was aimed at (a map's source, a child...)."""

    count: int = 0
    applied: int = 0
    refused: int = 0
    errors: int = 0
    targets: Counter[str] = field(default_factory=Counter)
    #: the first few errors' text
    samples: list[str] = field(default_factory=list)


class Mixer:
    """Deals operator actions at the soak's runs (see the module docstring)."""

    def __init__(
        self, orc: Orchestrator, rng: random.Random, echo: Callable[[str], None], *, resource: str = "chaos-res"
    ) -> None:
        self.orc, self.rng, self.echo, self.resource = orc, rng, echo, resource
        #: violations found by the actions themselves (a foreign tenant's event that woke a
        #: wait; a run ``db clean`` was about to remove that broke the promise)
        self.problems: list[str] = []
        #: runs ``db clean`` removed (verified just before)
        self.removed: set[str] = set()
        #: when the open breaker is closed again (monotonic), if one is open
        self.close_at: float | None = None
        #: approvals answered after the last action (a person answering what is left)
        self.answered_after = 0
        self._next_answer = 0.0
        self._seen: set[str] = set()
        self.run_ids: list[str] = []
        self.tallies: dict[str, Tally] = defaultdict(Tally)
        self.deck: list[str] = []
        #: run id -> the action kinds applied to it (a refusal counts too: it wrote a ledger row)
        self.touched: dict[str, set[str]] = defaultdict(set)
        #: runs the actions started (reruns), for the soak to follow
        self.new_runs: list[str] = []
        self.last_action = time.monotonic()
        #: what the current action aims at (a map's source, a child, an open run...)
        self.target = "run"

    def setup(self) -> None:
        """The breaker, schedule and trigger the actions use."""
        self.orc.breakers.set(self.resource, min_calls=1000, open_for="2s..4s", by="chaos")
        small = DAG("chaos-fired", tenant=DEFAULT_TENANT)
        first = small.task("a", "tasks.probes.noop", max_attempts=10, backoff={"base": 0.2, "cap": 1.0})
        small.task("b", "tasks.probes.echo", upstream=[first], max_attempts=10, backoff={"base": 0.2, "cap": 1.0})
        self.orc.schedules.add("chaos-sched", every=60.0, spec=small, catchup="none")
        self.orc.triggers.add("chaos-trig", event=TRIGGER_EVENT, spec=small)

    @property
    def busy(self) -> bool:
        """An action still has something to undo (a breaker to close)."""
        return self.close_at is not None

    def tick(self, run_ids: list[str], *, answer_all: bool = False) -> None:
        """Close the breaker when due; with ``answer_all``, approve every approval still waiting
        (once a second)."""
        now = time.monotonic()
        if self.close_at is not None and now >= self.close_at:
            try:
                self.orc.breakers.close(self.resource, by="chaos", reason="soak")
                self.close_at = None
            except Exception as exc:  # noqa: BLE001 - a fault: try again in a second
                self.echo(f"closing breaker {self.resource} failed ({type(exc).__name__}); retrying")
                self.close_at = now + 1.0
        if answer_all and now >= self._next_answer:
            self._next_answer = now + 1.0
            try:
                for run_id, key in self._approvals(run_ids):
                    self.orc.approve(run_id, key, by="chaos", comment="after the last action")
                    self.answered_after += 1
            except Exception:  # noqa: BLE001 - a fault or a race: the next second tries again
                pass

    @property
    def count(self) -> int:
        return sum(t.count for t in self.tallies.values())

    def _draw(self) -> str:
        if not self.deck:
            self.deck = list(ACTIONS)
            self.rng.shuffle(self.deck)
        return self.deck.pop()

    def act(self, run_ids: list[str]) -> None:
        """One action of the next kind at a random run of ``run_ids`` (open ones preferred)."""
        if not run_ids:
            return
        self.run_ids = run_ids
        kind = self._draw()
        tally = self.tallies[kind]
        tally.count += 1
        self.last_action = time.monotonic()
        run_id = ""
        self.target = "run"
        try:
            run_id, self.target = self._pick_run(run_ids, open_only=kind == "cancel")
            self.touched[run_id].add(kind)
            getattr(self, kind)(run_id)
            tally.applied += 1
        except Exception as exc:  # noqa: BLE001 - every outcome is recorded, the soak goes on
            if isinstance(exc, REFUSALS):
                tally.refused += 1
            else:
                tally.errors += 1
                if len(tally.samples) < 3:
                    tally.samples.append(f"{run_id}: {type(exc).__name__}: {str(exc)[:200]}")
        tally.targets[self.target] += 1

    def _pick_run(self, run_ids: list[str], *, open_only: bool = False) -> tuple[str, str]:
        states = run_states(self.orc, run_ids)
        open_ids = [r for r in run_ids if states.get(r) == "RUNNING"]
        if open_ids and (open_only or self.rng.random() < 0.7):
            return self.rng.choice(open_ids), "open run"
        return self.rng.choice(run_ids), "run"

    def _pick_task(self, run_id: str, prefer: tuple[str, ...] = ()) -> tuple[str, str]:
        """A task of the run and what it is: a map's ``source`` (what a map maps over), a
        ``map`` (its children's header), a map's ``child``, a ``branch``, a ``wait`` or
        ``other``, each kind the run has about as likely (so maps and branches are aimed at
        often); ``prefer``: tasks in these states first, when there are any."""
        tasks = self.orc.tasks(run_id)
        keys = {t.key for t in tasks}
        preferred = [t for t in tasks if t.state.value in prefer]
        kinds: dict[str, list[str]] = defaultdict(list)
        for task in preferred or tasks:
            if task.map_parent is not None:
                what = "child"
            elif task.key == "ls" or (task.key == "m" and "m2" in keys):
                what = "source"
            elif task.map_counts is not None or task.key in ("m", "m2"):
                what = "map"
            elif task.key == "pick":
                what = "branch"
            elif task.task == WAIT_TASK:
                what = "wait"
            else:
                what = "other"
            kinds[what].append(task.key)
        what = self.rng.choice(sorted(kinds))
        return self.rng.choice(kinds[what]), what

    # -- the actions: each sets ``self.target`` (what it aimed at) before it acts

    def clear(self, run_id: str) -> None:
        key, self.target = self._pick_task(run_id)
        self.orc.clear(run_id, key, by="chaos")

    def clear_downstream(self, run_id: str) -> None:
        key, self.target = self._pick_task(run_id)
        self.orc.clear(run_id, key, downstream=True, by="chaos")

    def mark(self, run_id: str) -> None:
        key, what = self._pick_task(run_id)
        to = self.rng.choice([TaskState.SUCCEEDED, TaskState.FAILED, TaskState.SKIPPED])
        self.target = f"{what} -> {to.value.lower()}"
        self.orc.mark(run_id, key, to, by="chaos")

    def retry(self, run_id: str) -> None:
        key, self.target = self._pick_task(run_id, prefer=("FAILED", "DEAD_LETTER"))
        self.orc.retry_task(run_id, key, by="chaos")

    def skip(self, run_id: str) -> None:
        key, self.target = self._pick_task(run_id, prefer=("DEAD_LETTER",))
        self.orc.skip_task(run_id, key, by="chaos")

    def cancel(self, run_id: str) -> None:
        self.orc.cancel(run_id, by="chaos")

    def rerun(self, run_id: str) -> None:
        self.new_runs.append(self.orc.rerun(run_id).id)

    def approve(self, run_id: str) -> None:
        """Answer a waiting approval (yes four times in five), any run's when this one has none."""
        waiting = self._approvals([run_id]) or self._approvals(self.run_ids)
        if waiting:
            run_id, key = self.rng.choice(waiting)
        else:
            key = "ok"
        self.touched[run_id].add("approve")
        if self.rng.random() < 0.8:
            self.target = "approval -> yes" if waiting else "no approval waiting"
            self.orc.approve(run_id, key, by="chaos")
        else:
            self.target = "approval -> no" if waiting else "no approval waiting"
            self.orc.reject(run_id, key, by="chaos")

    def foreign_emit(self, run_id: str) -> None:
        """Another tenant emits the events the run's waits match: it must wake nothing."""
        run = self.orc.visible(run_id)
        i = run.dag.rpartition("-")[2]
        other = self.rng.choice([t for t in TENANTS if t != run.tenant])
        self.target = f"{run.tenant}'s keys from {other}"
        for key in (f"chaos.{i}", f"chaos.{i}.resume"):
            done = self.orc.events.emit(key, {"i": int(i) if i.isdigit() else i, "from": other}, tenant=other,
                                 event_id=f"foreign-{run_id}-{key}-{self.count}")  # fmt: skip
            if done.woken:
                self.problems.append(f"run {run_id}: {other}'s event {key} woke {done.woken} wait(s) of {run.tenant}")

    def breaker(self, run_id: str) -> None:
        """Open the resource's breaker (its tasks held READY); closed 1-4 s later."""
        if self.close_at is not None:
            self.target = "already open"
            return
        self.orc.breakers.open(self.resource, by="chaos", reason="soak")
        self.close_at = time.monotonic() + 1.0 + 3.0 * self.rng.random()
        self.target = "opened"

    def schedule(self, run_id: str) -> None:
        """A schedule firing: by hand (``schedule trigger``) or a scheduler pass (due at most
        once a minute, whatever the passes)."""
        if self.rng.random() < 0.5:
            self.target = "by hand"
            self.orc.schedules.trigger("chaos-sched")
        else:
            self.target = "scheduler pass"
            self.orc.schedules.tick()
        self.new_runs += self._discover()

    def trigger(self, run_id: str) -> None:
        """An event that starts a run through the soak's trigger."""
        self.target = "event"
        self.orc.events.emit(TRIGGER_EVENT, {"n": self.count}, event_id=f"trigger-{self.count}")
        self.new_runs += self._discover()

    def db_clean(self, run_id: str) -> None:
        """``db clean`` of every run final now, each verified first (a run that broke the
        promise is reported before it goes)."""
        with self.orc.store.engine.connect() as conn:
            cut = conn.execute(sa.text("SELECT now()")).scalar_one()
            final = [str(r) for r in conn.execute(_FINAL_BEFORE, {"cut": cut}).scalars()]
        if final:
            self.problems += self.orc.verify(final)
        cleaned = self.orc.store.cleanup.clean(cut, batch=200)
        after = set(run_states(self.orc, final))
        self.removed |= set(final) - after
        self.target = f"{cleaned.runs} runs"

    def _approvals(self, run_ids: list[str]) -> list[tuple[str, str]]:
        with self.orc.store.engine.connect() as conn:
            rows = conn.execute(_APPROVALS, {"ids": list(run_ids)})
            return [(str(r), str(k)) for r, k in rows]

    def _discover(self) -> list[str]:
        """Runs nobody followed yet (started by a schedule or a trigger)."""
        known = set(self.touched) | self._seen
        with self.orc.store.engine.connect() as conn:
            found = [str(r) for r in conn.execute(_FIRED_RUNS).scalars()]
        new = [r for r in found if r not in known]
        self._seen |= set(new)
        return new

    # -- the report

    def blame(self, problems: list[str]) -> Counter[str]:
        """Violations per action kind: each problem line counts for every kind that touched its run."""
        found: Counter[str] = Counter()
        for line in problems:
            match = _RUN_ID.search(line)
            for kind in self.touched.get(match.group(0), ()) if match else ():
                found[kind] += 1
        return found

    def annotate(self, problems: list[str]) -> list[str]:
        """Each problem line with the action kinds that touched its run (``[actions: ...]``)."""
        out = []
        for line in problems:
            match = _RUN_ID.search(line)
            kinds = sorted(self.touched.get(match.group(0), ())) if match else []
            out.append(f"{line} [actions: {', '.join(kinds)}]" if kinds else line)
        return out

    def summary(self, problems: list[str]) -> dict[str, Any]:
        blamed = self.blame(problems)
        return {
            kind: {
                "count": t.count, "applied": t.applied, "refused": t.refused, "errors": t.errors,
                "violations": blamed.get(kind, 0), "targets": dict(t.targets), "samples": t.samples,
            }
            for kind, t in sorted(self.tallies.items())
        }  # fmt: skip


_RUN_STATES = sa.text("SELECT id, state FROM orc_runs WHERE id = ANY(:ids)")
_FINAL_BEFORE = sa.text("SELECT id FROM orc_runs WHERE state <> 'RUNNING' AND finished_at < :cut")
_APPROVALS = sa.text(
    "SELECT run_id, key FROM orc_tasks WHERE run_id = ANY(:ids) AND state = 'WAITING' AND key = 'ok' ORDER BY 1, 2"
)
_FIRED_RUNS = sa.text("SELECT id FROM orc_runs WHERE dag_name = 'chaos-fired'")


def run_states(orc: Orchestrator, run_ids: list[str]) -> dict[str, str]:
    """Each run's state (runs removed by ``db clean`` are absent)."""
    with orc.store.engine.connect() as conn:
        return {str(i): str(st) for i, st in conn.execute(_RUN_STATES, {"ids": list(run_ids)})}
