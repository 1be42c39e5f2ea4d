"""A submit: the checks beyond the DAG's own, the run's row with its tasks (one transaction), then
admission and the first messages (:meth:`orchestrator.engine.facade.Orchestrator.submit`)."""

from __future__ import annotations

from typing import Any

from ..core.dag import DAG, MAX_IDEMPOTENCY_KEY_CHARS, MAX_LOGICAL_DATE_CHARS, text_problem
from ..core.dag.canvas import is_canvas
from ..core.errors import ValidationError
from ..core.flow import FlowOptions, check_flow
from ..core.routing import route
from ..core.tags import check_tags
from ..core.workers import MAX_QUEUE_CHARS, check_code_version, pinned_queue
from .checks import iso_problem
from .flow import Keyed
from .runs import RunHandle
from .tracing import capture_trace_context


def as_dag(dag: Any) -> DAG:
    """``dag`` itself, or the DAG a Celery canvas (a signature, chain, group or chord) makes."""
    if isinstance(dag, DAG):
        return dag
    if is_canvas(dag):
        return DAG.from_canvas(dag)
    raise ValidationError(f"submit takes a DAG or a Celery canvas, not {type(dag).__name__}")


def submit_run(
    orc: Any,
    dag: DAG,
    *,
    idempotency_key: str | None,
    tenant: str | None,
    logical_date: str | None,
    schedule: str | None,
    dag_version: int | None,
    trigger: str | None,
    code_version: str | None,
    tags: Any = None,
    flow_options: FlowOptions | None = None,
) -> RunHandle:
    """What :meth:`Orchestrator.submit` does (its docstring says it); ``orc`` is the orchestrator."""
    checked_tags = check_tags(tags)  # TagError before anything else is read or written
    flow = check_flow(flow_options) if flow_options else None  # FlowControlError likewise
    dag = orc.check(as_dag(dag), tenant=tenant)
    if code_version is not None:
        check_code_version(code_version, dag.name)
    if idempotency_key is not None:
        problem = text_problem(idempotency_key, MAX_IDEMPOTENCY_KEY_CHARS)
        if problem:
            raise ValidationError(f"idempotency key {problem}", dag=dag.name)
    if logical_date is not None:
        problem = text_problem(logical_date, MAX_LOGICAL_DATE_CHARS) or iso_problem(logical_date)
        if problem:
            raise ValidationError(f"logical_date {problem}", dag=dag.name)
    if schedule is not None:
        # a schedule's run: its tenant's schedule only (names are per tenant; another
        # tenant's schedule of that name is another schedule, with runs of its own)
        rows = orc.store.schedule_rows.scoped(dag.tenant)
        found = rows.get(schedule) if isinstance(schedule, str) else None
        if found is None:
            raise ValidationError(f"no schedule named {schedule!r} for tenant {dag.tenant!r}", dag=dag.name)
        if logical_date is None:
            raise ValidationError(f"a run of schedule {schedule!r} needs its logical_date", dag=dag.name)
    dedicated = set(orc.settings.dedicated_tenants)
    if dag.tenant not in dedicated and dag.tenant in orc.store.tenants.dedicated():
        dedicated.add(dag.tenant)
    queues = {n.key: route(dag.tenant, dag.priority_of(n), n.queue, dedicated) for n in dag.nodes.values()}
    if code_version is not None:
        queues = {key: pinned_queue(queue, code_version) for key, queue in queues.items()}
        long = sorted(q for q in set(queues.values()) if len(q) > MAX_QUEUE_CHARS)
        if long:
            raise ValidationError(
                f"code_version {code_version!r}: queue {long[0]!r} is longer than {MAX_QUEUE_CHARS} characters",
                dag=dag.name,
            )
    wants = {name: orc.registry.wants_upstream(name) for name in {n.task for n in dag.nodes.values()}}
    keyed = Keyed(orc, dag.tenant, flow) if flow is not None else None
    run_id, created = orc.store.submission.create_run(
        dag,
        queues=queues,
        wants_upstream=wants.__getitem__,
        idempotency_key=idempotency_key,
        logical_date=logical_date,
        schedule=schedule,
        dag_version=dag_version,
        trigger=trigger,
        trace_context=capture_trace_context(),
        code_version=code_version,
        default_max_active=orc.settings.run_max_active_tasks or None,
        stripes=orc.settings.fanin_stripes,
        tags=checked_tags,
        hold=keyed.hold if keyed else None,
        link=keyed.link if keyed else None,
    )
    if created and (keyed is None or keyed.after(run_id)):
        orc.publisher.publish(orc.store.admission.admit_ready(orc.settings.dispatch_window))
    warnings = dag.lint() + (keyed.warnings if keyed and created else [])
    if schedule is None and orc.store.dags.is_paused(dag.tenant, dag.name):
        warnings.append(
            f"DAG {dag.name!r} is paused: schedules and events start no run of it; this submit by hand does"
            f" (orchestrator dag unpause {dag.name})"
        )
    return RunHandle(orc, run_id, warnings=warnings)
