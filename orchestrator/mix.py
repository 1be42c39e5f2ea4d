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

from .engine import Orchestrator
from .errors import OperatorError, RunNotFound, TaskNotFound, ValidationError
from .states import TaskState
from .waits import WAIT_TASK

#: every kind of operator action, once per round of the deck
ACTIONS = ["clear", "clear_downstream", "mark", "retry", "skip", "cancel", "rerun"]
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

    def __init__(self, orc: Orchestrator, rng: random.Random, echo: Callable[[str], None]) -> None:
        self.orc, self.rng, self.echo = orc, rng, echo
        self.tallies: dict[str, Tally] = defaultdict(Tally)
        self.deck: list[str] = []
        #: run id -> the action kinds applied to it (a refusal counts too: it wrote a ledger row)
        self.touched: dict[str, set[str]] = defaultdict(set)
        #: runs the actions started (reruns), for the soak to follow
        self.new_runs: list[str] = []
        self.last_action = time.monotonic()
        #: what the current action aims at (a map's source, a child, an open run...)
        self.target = "run"

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
        ``other``; ``prefer``: tasks in these states first, when there are any."""
        tasks = self.orc.tasks(run_id)
        keys = {t.key for t in tasks}
        preferred = [t for t in tasks if t.state.value in prefer]
        task = self.rng.choice(preferred or tasks)
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
        return task.key, what

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

    # -- the report

    def blame(self, problems: list[str]) -> Counter[str]:
        """Violations per action kind: each problem line counts for every kind that touched its run."""
        found: Counter[str] = Counter()
        for line in problems:
            match = _RUN_ID.search(line)
            for kind in self.touched.get(match.group(0), ()) if match else ():
                found[kind] += 1
        return found

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


def run_states(orc: Orchestrator, run_ids: list[str]) -> dict[str, str]:
    """Each run's state (runs removed by ``db clean`` are absent)."""
    with orc.store.engine.connect() as conn:
        return {str(i): str(st) for i, st in conn.execute(_RUN_STATES, {"ids": list(run_ids)})}
