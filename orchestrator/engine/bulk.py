"""``orc.bulk``: one operator action on every run a filter selects (tags, a run state, a DAG):
``cancel``, ``retry`` (the runs' failed tasks) or ``rerun``, each run through the orchestrator's
own per-run operation (:meth:`~orchestrator.engine.Orchestrator.cancel`, ``retry_task`` and
``clear``, ``rerun``), so every change is the compare-and-set those make, with its ledger row
naming ``by``. ``dry_run`` says what each run would get and writes nothing.

A filter is required (:class:`~orchestrator.core.errors.BulkFilterError` without one), and one
action changes at most :data:`MAX_BULK_RUNS` runs. A run the action does not apply to is reported
``skipped`` with the reason; a run whose operation is refused when it is applied (another writer
changed it first) is reported ``failed`` with the refusal, and the others go on. Bound to a
tenant, the orchestrator selects and acts on its own tenant's runs only (its reads and actions
are scoped in the store)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..core.dag import text_problem
from ..core.errors import BulkFilterError, OrchestratorError, ValidationError
from ..core.models import RunView
from ..core.states import RunState, TaskState
from ..core.tags import check_tags, tags_text

#: the actions, as ``orchestrator bulk ACTION`` and ``POST /api/bulk/ACTION`` name them
BULK_ACTIONS = ("cancel", "retry", "rerun")

#: the most runs one bulk action may select (more: refused, narrow the filter)
MAX_BULK_RUNS = 1000

#: an item's outcome: it would change (a dry run), it changed, the action does not apply to the
#: run, or its operation was refused when applied
PLANNED, DONE, SKIPPED, FAILED = "planned", "done", "skipped", "failed"

#: the most task keys an item's detail names (the rest are counted)
KEYS_SHOWN = 10

#: the task states a bulk retry sends back to run
RETRIED = (TaskState.FAILED.value, TaskState.DEAD_LETTER.value)


class BulkPort(Protocol):
    """What :class:`Bulk` calls on its :class:`~orchestrator.engine.Orchestrator`."""

    @property
    def reads(self) -> Any: ...

    def runs(
        self, limit: int = 20, tenant: str | None = None, *, dag: str | None = None, state: Any = None,
        offset: int = 0, dag_version: int | None = None, tags: Mapping[str, str] | None = None,
    ) -> list[RunView]: ...  # fmt: skip
    def cancel(self, run_id: str, *, by: str | None = None) -> int: ...
    def retry_task(self, run_id: str, key: str, *, by: str | None = None) -> None: ...
    def clear(
        self, run_id: str, *keys: str, downstream: bool = False, upstream: bool = False, only_failed: bool = False,
        dry_run: bool = False, by: str | None = None, setup: bool = True,
    ) -> list[str]: ...  # fmt: skip
    def rerun(self, run_id: str) -> Any: ...


@dataclass(frozen=True)
class BulkItem:
    """One selected run and what the action did (or would do) to it."""

    run_id: str
    dag: str
    tenant: str
    #: the run's state when it was selected
    state: str
    tags: dict[str, str]
    #: :data:`PLANNED`, :data:`DONE`, :data:`SKIPPED` or :data:`FAILED`
    outcome: str
    #: what it does / did, or why it was skipped or refused
    detail: str
    #: a rerun's new run
    new_run: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run_id, "dag": self.dag, "tenant": self.tenant, "state": self.state, "tags": dict(self.tags),
            "outcome": self.outcome, "detail": self.detail, "new_run": self.new_run,
        }  # fmt: skip


@dataclass(frozen=True)
class BulkReport:
    """What one bulk action selected and did: an item per selected run, newest first."""

    action: str
    dry_run: bool
    tags: dict[str, str]
    state: str | None
    dag: str | None
    items: list[BulkItem] = field(default_factory=list)
    #: the tenant filter (``None``: every tenant the orchestrator sees)
    tenant: str | None = None

    def count(self, outcome: str) -> int:
        return sum(1 for i in self.items if i.outcome == outcome)

    @property
    def changed(self) -> int:
        """The runs that changed (a dry run: that would change)."""
        return self.count(PLANNED) + self.count(DONE)

    def filter_text(self) -> str:
        parts = [f"--tag {k}={v}" for k, v in sorted(self.tags.items())]
        parts += [f"--state {self.state}"] if self.state else []
        parts += [f"--dag {self.dag}"] if self.dag else []
        parts += [f"--tenant {self.tenant}"] if self.tenant else []
        return " ".join(parts)

    def summary(self) -> str:
        """One line: ``bulk retry: 3 run(s) retried, 1 skipped, 0 failed (4 matching ...)``."""
        verb = (
            f"would {self.action}"
            if self.dry_run
            else {"cancel": "cancelled", "retry": "retried"}.get(self.action, "rerun")
        )
        dry = " (dry run: nothing written)" if self.dry_run else ""
        return (
            f"bulk {self.action}{dry}: {self.changed} run(s) {verb}, {self.count(SKIPPED)} skipped,"
            f" {self.count(FAILED)} failed, of {len(self.items)} matching {self.filter_text()}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "dry_run": self.dry_run,
            "filter": {"tags": dict(self.tags), "state": self.state, "dag": self.dag, "tenant": self.tenant},
            "matched": len(self.items),
            "changed": self.changed,
            "skipped": self.count(SKIPPED),
            "failed": self.count(FAILED),
            "runs": [i.to_json() for i in self.items],
        }


def _names(keys: list[str]) -> str:
    shown = ", ".join(keys[:KEYS_SHOWN])
    return shown + (f" and {len(keys) - KEYS_SHOWN:,} more" if len(keys) > KEYS_SHOWN else "")


class Bulk:
    """The bulk actions of one orchestrator (``orc.bulk``): :meth:`select` the runs a filter
    matches, :meth:`cancel`, :meth:`retry` or :meth:`rerun` them (or :meth:`apply` an action by
    name), each returning a :class:`BulkReport`."""

    def __init__(self, orc: BulkPort) -> None:
        self.orc = orc

    def select(
        self, *, tags: Mapping[str, str] | None = None, state: RunState | str | None = None, dag: str | None = None,
        tenant: str | None = None,
    ) -> list[RunView]:  # fmt: skip
        """The runs the filter matches (every tag of ``tags``, and ``state``, and ``dag``, and of
        ``tenant``: it narrows, it is no filter alone), newest first. Raises
        :class:`BulkFilterError` for no filter at all or more than :data:`MAX_BULK_RUNS` runs,
        :class:`ValidationError` (:class:`TagError`) for a bad one."""
        found_tags, found_state, found_dag = self._filter(tags, state, dag)
        views = self.orc.runs(MAX_BULK_RUNS + 1, tenant or None, dag=found_dag, state=found_state, tags=found_tags)
        if len(views) > MAX_BULK_RUNS:
            raise BulkFilterError(
                f"more than {MAX_BULK_RUNS:,} runs match; a bulk action changes at most {MAX_BULK_RUNS:,}:"
                " narrow the filter (another tag, a state or a DAG)"
            )
        return views

    @staticmethod
    def _filter(
        tags: Mapping[str, str] | None, state: RunState | str | None, dag: str | None
    ) -> tuple[dict[str, str], RunState | None, str | None]:
        found_tags = check_tags(tags, what="the tag filter")
        found_state: RunState | None = None
        if state is not None and state != "":
            try:
                found_state = RunState(str(state).upper())
            except ValueError:
                raise ValidationError(f"unknown run state {state!r}; one of {', '.join(RunState)}") from None
        if dag == "":
            dag = None
        if dag is not None:
            problem = text_problem(dag, 200)
            if problem:
                raise ValidationError(f"the DAG filter {problem}")
        if not found_tags and found_state is None and dag is None:
            raise BulkFilterError(
                "a bulk action needs a filter: a tag (KEY=VALUE), a run state or a DAG; it never acts on every run"
            )
        return found_tags, found_state, dag

    def apply(
        self, action: str, *, tags: Mapping[str, str] | None = None, state: RunState | str | None = None,
        dag: str | None = None, tenant: str | None = None, dry_run: bool = False, by: str | None = None,
    ) -> BulkReport:  # fmt: skip
        """The bulk ``action`` (one of :data:`BULK_ACTIONS`) on the runs the filter selects; with
        ``dry_run`` what it would do, nothing written. ``by`` names who acts in each ledger row.
        Raises :class:`ValidationError` for an unknown action or a bad filter,
        :class:`BulkFilterError` for none (nothing is touched in either case)."""
        one: dict[str, Callable[[RunView, bool, str | None], BulkItem]] = {
            "cancel": self._cancel, "retry": self._retry, "rerun": self._rerun,
        }  # fmt: skip
        if action not in one:
            raise ValidationError(f"unknown bulk action {action!r}; one of {', '.join(BULK_ACTIONS)}")
        found_tags, found_state, found_dag = self._filter(tags, state, dag)
        views = self.select(tags=found_tags, state=found_state, dag=found_dag, tenant=tenant)
        items = [one[action](view, dry_run, by) for view in views]
        state_text = found_state.value if found_state else None
        return BulkReport(action, dry_run, found_tags, state_text, found_dag, items, tenant or None)

    def cancel(self, **filters: Any) -> BulkReport:
        """Cancel every RUNNING run the filter selects (:meth:`Orchestrator.cancel`); see :meth:`apply`."""
        return self.apply("cancel", **filters)

    def retry(self, **filters: Any) -> BulkReport:
        """Run the failed tasks of every selected run again: each DEAD_LETTER task retried
        (:meth:`Orchestrator.retry_task`), the FAILED ones cleared with their FAILED and
        UPSTREAM_FAILED downstream (:meth:`Orchestrator.clear`, ``only_failed``): a FAILED run
        reopens; see :meth:`apply`."""
        return self.apply("retry", **filters)

    def rerun(self, **filters: Any) -> BulkReport:
        """A new run (same DAG snapshot, params and tags) of every finished run selected
        (:meth:`Orchestrator.rerun`); see :meth:`apply`."""
        return self.apply("rerun", **filters)

    # ------------------------------------------------------------------ one run each

    @staticmethod
    def _item(view: RunView, outcome: str, detail: str, new_run: str | None = None) -> BulkItem:
        return BulkItem(view.id, view.dag, view.tenant, view.state.value, dict(view.tags), outcome, detail, new_run)

    def _cancel(self, view: RunView, dry_run: bool, by: str | None) -> BulkItem:
        if view.state is not RunState.RUNNING:
            why = "already CANCELLED" if view.state is RunState.CANCELLED else f"run is {view.state.value}"
            return self._item(view, SKIPPED, f"{why}: only a RUNNING run can be cancelled")
        if dry_run:
            return self._item(view, PLANNED, f"cancel: {view.open_tasks:,} open task(s) become CANCELLED")
        try:
            revoked = self.orc.cancel(view.id, by=by)
        except OrchestratorError as exc:
            return self._item(view, FAILED, f"cancel refused: {exc}")
        return self._item(view, DONE, f"cancelled; {revoked} running or queued task(s) revoked")

    def _retry(self, view: RunView, dry_run: bool, by: str | None) -> BulkItem:
        if view.state is RunState.CANCELLED:
            return self._item(view, SKIPPED, "run is CANCELLED: its tasks cannot be retried (rerun it instead)")
        if view.state is RunState.SUCCEEDED:
            return self._item(view, SKIPPED, "run SUCCEEDED: nothing to retry")
        if not any(view.counts.get(s, 0) for s in RETRIED):
            return self._item(view, SKIPPED, f"run is {view.state.value}: no FAILED or DEAD_LETTER task")
        done: list[str] = []
        try:
            found = self.orc.reads.keys_in_states(view.id, RETRIED)
            dead = [k for k, s in found if s == TaskState.DEAD_LETTER.value]
            failed = [k for k, s in found if s == TaskState.FAILED.value]
            if not found:
                return self._item(view, SKIPPED, "no FAILED or DEAD_LETTER task any more")
            if not dry_run:
                for key in dead:
                    self.orc.retry_task(view.id, key, by=by)
                    done.append(key)
            cleared = (
                self.orc.clear(view.id, *failed, downstream=True, only_failed=True, dry_run=dry_run, by=by)
                if failed
                else []
            )
        except OrchestratorError as exc:
            before = f"retried {_names(done)}; then " if done else ""
            return self._item(view, FAILED, f"{before}retry refused: {exc}")
        parts = [f"retry {len(dead):,} DEAD_LETTER task(s): {_names(dead)}"] if dead else []
        if failed:
            parts.append(
                f"clear {len(failed):,} FAILED task(s) with their failed downstream, {len(cleared):,} task(s) to run"
                f" again: {_names(cleared)}"
            )
        return self._item(view, PLANNED if dry_run else DONE, "; ".join(parts))

    def _rerun(self, view: RunView, dry_run: bool, by: str | None) -> BulkItem:
        if view.state is RunState.RUNNING:
            return self._item(view, SKIPPED, "run is RUNNING: only a finished run is rerun (cancel it first)")
        tagged = f" and tags ({tags_text(view.tags)})" if view.tags else ""
        if dry_run:
            return self._item(view, PLANNED, f"a new run of its DAG snapshot, params{tagged}")
        try:
            handle = self.orc.rerun(view.id)
        except OrchestratorError as exc:
            return self._item(view, FAILED, f"rerun refused: {exc}")
        return self._item(view, DONE, f"new run {handle.id}, a rerun of it", new_run=str(handle.id))
