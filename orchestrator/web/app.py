"""``orchestrator serve``: a small Tornado web app over the database (the source of truth).

Pages (server-rendered, no build step, nothing from a CDN):

* ``/runs`` - runs with filters (``tenant``, ``dag``, ``state``, ``tag=KEY=VALUE`` repeatable: runs
  holding every one) and paging (``page``), each run with its tags; with a filter, a form for a
  bulk action on every run it matches (``POST /bulk/cancel|retry|rerun``: a dry run's preview
  first, then a form that applies it; :mod:`.bulk`);
* ``/runs/RUN_ID`` - the run: its DAG drawn (:mod:`orchestrator.core.graph`; a big one in counted
  groups), the task table (paged, with a state filter and a key search) with the reason each
  waiting task waits (:mod:`orchestrator.core.explain`), the ledger (paged), and operator
  actions as POST forms with an XSRF token: retry / skip / fail a task, clear it (with its
  downstream or not) or mark it success / failed / skipped, cancel the run or rerun it (a new
  run, linked to it, whose page the browser goes on to). A refused action answers its error
  page (400 / 404 / 409 with the reason): a refused clear, mark or rerun writes nothing (a
  refused retry, skip, fail or cancel leaves its refusal in the ledger). A map
  is one box counting its children (``resize \u00d710,000 · 9,990 ok · 10 failed``); a click on it
  draws its children (``/runs/RUN_ID?part=map&key=KEY``, the first :data:`~.drawing.MAP_CELLS`); a map
  child's key (``resize[3]``) pages, searches and acts like any other (URL-encoded in paths).
  A task group (``DAG.group``) is one box counting its tasks by state (``▸ section_1``); a click
  on it draws its tasks (``?part=dag&expand=section_1``: its inner groups folded in turn). An
  edge's label (``DAG.label``) is written on its arrow.

JSON for scripts (the pages' data, same addresses under ``/api``):

* ``GET /api/runs?tenant=&dag=&state=&tag=KEY=VALUE&limit=&offset=`` - ``{"runs": [...]}`` (each
  with its ``tags``; ``tag`` repeatable: runs holding every one);
* ``POST /api/bulk/cancel|retry|rerun`` with the filter (``tag=KEY=VALUE`` repeatable, ``state``,
  ``dag``, ``tenant``; at least one of the first three) and ``dry_run=1`` to see what would change -
  ``{"ok": true, "action", "dry_run", "filter", "matched", "changed", "skipped", "failed", "runs":
  [{"run", "outcome": "planned|done|skipped|failed", "detail", "new_run", ...}]}``, or
  ``{"error": ...}`` with 400 (no filter, a bad one, more than 1,000 runs);
* ``GET /api/runs/RUN_ID?limit=&after=&before=&state=&q=&events=&events_before=&edges_after=`` -
  ``{"run", "counts", "tasks", "edges", "waiting", "events", "page", "next"}``, paged: 500 tasks
  (by key), edges and ledger rows unless told otherwise, ``next`` the links to the next pages
  (the edge cursor ``edges_after=PARENT~CHILD``: a key may hold a group's ``.``, never ``~``);
* ``GET /api/runs/RUN_ID/changes?after=EVENT_ID&expand=`` - what changed since a ledger id (the
  run page polls it instead of reloading; ``expand``: the task groups it draws task by task);
* ``GET /api/runs/RUN_ID/graph?format=svg|dot|mermaid&expand=`` - the picture, each task group
  one box but those in ``expand`` (comma-separated full names; ``*``: every task drawn);
* ``POST /api/runs/RUN_ID/cancel|rerun`` and ``POST /api/runs/RUN_ID/tasks/KEY/retry|skip|fail|clear|mark``
  (``clear``: ``downstream=1`` to clear the task's descendants too, ``no_setup=1`` to leave out
  the setups it works under and their teardowns, cleared with it by default; ``mark``:
  ``state=success|failed|skipped``, as form fields or query parameters) - ``{"ok": true, ...}``
  (a clear adds ``cleared``, the keys; a mark ``was``, the state the task held; a rerun
  ``rerun``, the new run's id, and ``url``, its page), or ``{"error": ...}`` with 400/403/404/409;
* ``GET /metrics`` - Prometheus text (:mod:`orchestrator.web.metrics`); ``GET /healthz``.

Tenants: the app shows and acts as its orchestrator does. Served by an orchestrator bound to a
tenant (``orchestrator --tenant T serve``, ``ORCHESTRATOR_TENANT``), every page, JSON document
and action of another tenant's run answers 404 exactly like a run that does not exist (the
orchestrator's reads and actions are scoped to the tenant in the store), the runs list holds the
tenant's runs only, and ``/metrics`` the tenant's families (not the deployment's workers).

Access (``ORCHESTRATOR_UI_AUTH``, :mod:`.auth`), the base handler with its security headers,
request limits and errors (:mod:`.base`), the pages (:mod:`.views`, one module per page) and the
JSON API (:mod:`.api`, one module per resource) live beside this module, which holds the
application, its URL table and the server (as Flower lays itself out). No handler holds SQL:
what the pages need is read through the orchestrator and the store's named reads.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import tornado.web

from ..core.errors import ConfigurationError
from .actions import ACTIONS
from .api.actions import ApiAction
from .api.bulk import ApiBulk
from .api.events import ApiEvents
from .api.runs import ApiChanges, ApiGraph, ApiRun, ApiRuns
from .auth import Access, LoginLimiter
from .base import log_request
from .drawing import run_graph
from .views.error import NotFound
from .views.login import Login, Logout
from .views.monitor import Health, Metrics
from .views.run import RunAction, RunPage, RunScript
from .views.runs import BulkPage, Home, RunsPage

__all__ = ["SERVER_OPTIONS", "Access", "make_app", "run_graph", "serve"]

if TYPE_CHECKING:
    from ..engine.facade import Orchestrator

#: Tornado's own limit on the request line and headers together, raised well above
#: :data:`~.base.MAX_URL_BYTES` and :data:`~.base.MAX_HEADER_BYTES` so such a request is read and
#: answered 414/431 (beyond it Tornado closes the connection without a status); a request body
#: (the forms hold an XSRF token, a token and a path) is at most 64 KiB, read within 30 s, and
#: an idle connection is closed after 5 minutes
SERVER_OPTIONS: dict[str, Any] = {
    "max_header_size": 1024 * 1024,
    "max_body_size": 64 * 1024,
    "body_timeout": 30.0,
    "idle_connection_timeout": 300.0,
}

RUN_ID = r"([A-Za-z0-9_-]{1,32})"

#: a task's key in a path: a map child's ``node[key]`` arrives as is or percent-encoded (Tornado
#: decodes the group); the store finds the task or answers 404
KEY_CHARS = r"[A-Za-z0-9_.,:=%\[\]-]{1,400}"

#: the actions' addresses (named groups: a run's own action has no task key); a task's
#: action is one of :data:`ACTIONS`
RUN_ACTION = r"/runs/(?P<run_id>[A-Za-z0-9_-]{1,32})/(?P<action>cancel|rerun)"

#: a bulk action on the runs a filter selects (:mod:`.bulk`)
BULK_ACTION = r"/bulk/(?P<action>cancel|retry|rerun)"

TASK_ACTION = rf"/runs/(?P<run_id>[A-Za-z0-9_-]{{1,32}})/tasks/(?P<key>{KEY_CHARS})/(?P<action>{'|'.join(ACTIONS)})"


def make_app(
    orc: Orchestrator,
    *,
    auth: str = "",
    bind: str = "127.0.0.1",
    cookie_secret: str | None = None,
    behind_tls_proxy: bool | None = None,
    limiter: LoginLimiter | None = None,
) -> Any:
    """The Tornado application (tests drive it directly; :func:`serve` listens). Raises
    :class:`ConfigurationError` for bad credentials, or none on a bind that is not loopback;
    without credentials on loopback, the token it makes is ``app.settings["access"].generated``.
    ``behind_tls_proxy`` (default: ``ORCHESTRATOR_UI_BEHIND_TLS_PROXY``) makes every cookie
    ``Secure``; ``limiter`` counts wrong credentials (default: :class:`LoginLimiter`'s budgets)."""
    access = Access(auth, bind)
    if behind_tls_proxy is None:
        behind_tls_proxy = bool(getattr(orc.settings, "ui_behind_tls_proxy", False))
    return tornado.web.Application(
        [
            (r"/", Home),
            (r"/healthz", Health),
            (r"/login", Login),
            (r"/logout", Logout),
            (r"/metrics", Metrics),
            (r"/runs/?", RunsPage),
            (BULK_ACTION, BulkPage),
            (rf"/runs/{RUN_ID}", RunPage),
            (RUN_ACTION, RunAction),
            (TASK_ACTION, RunAction),
            (r"/api/runs/?", ApiRuns),
            (rf"/api/runs/{RUN_ID}", ApiRun),
            (rf"/api/runs/{RUN_ID}/graph", ApiGraph),
            (rf"/api/runs/{RUN_ID}/changes", ApiChanges),
            (r"/static/run\.js", RunScript),
            ("/api" + RUN_ACTION, ApiAction),
            ("/api" + TASK_ACTION, ApiAction),
            (r"/api/events", ApiEvents),
            ("/api" + BULK_ACTION, ApiBulk),
        ],
        orc=orc,
        access=access,
        tenant_orcs=_tenant_orcs(orc, access),
        default_handler_class=NotFound,
        pool=ThreadPoolExecutor(max_workers=4, thread_name_prefix="orc-web"),
        xsrf_cookies=True,
        xsrf_cookie_kwargs={"httponly": True, "samesite": "Strict", **({"secure": True} if behind_tls_proxy else {})},
        behind_tls_proxy=behind_tls_proxy,
        limiter=limiter or LoginLimiter(),
        log_function=log_request,
        cookie_secret=cookie_secret or secrets.token_hex(32),
        autoescape="xhtml_escape",
    )


def _tenant_orcs(orc: Orchestrator, access: Access) -> dict[str, Orchestrator]:
    """An orchestrator bound to each tenant a credential is bound to (the store's tenant wall),
    sharing the app's store, publisher and registry."""
    from ..engine.facade import Orchestrator as Facade

    found: dict[str, Orchestrator] = {}
    for tenant in sorted(access.tenants):
        if orc.tenant is not None and tenant != orc.tenant:
            raise ConfigurationError(
                f"ORCHESTRATOR_UI_AUTH binds a credential to tenant {tenant!r}, but this serve acts as"
                f" tenant {orc.tenant!r} only"
            )
        found[tenant] = Facade(
            orc.settings, app=orc.app, store=orc.store, publisher=orc.publisher, registry=orc.registry, tenant=tenant
        )
    return found


def serve(
    orc: Orchestrator,
    *,
    host: str,
    port: int,
    auth: str = "",
    ready: Callable[[str], None] | None = None,
    behind_tls_proxy: bool | None = None,
) -> None:
    """Listen on ``host:port`` until interrupted. Without credentials (loopback only), the
    login URL with the token made at start is passed to ``ready``."""
    import tornado.ioloop

    app = make_app(orc, auth=auth, bind=host, behind_tls_proxy=behind_tls_proxy)
    access: Access = app.settings["access"]
    server = app.listen(port, address=host, **SERVER_OPTIONS)
    shown = f"[{host}]" if ":" in host else (host or "0.0.0.0")
    if ready is not None:
        ready(f"serving on http://{shown}:{port}/runs - authentication required; pid {os.getpid()}")
        if access.generated:
            ready(
                f"log in (token made at start, valid until exit): http://{shown}:{port}/login?token={access.generated}"
            )
    try:
        tornado.ioloop.IOLoop.current().start()
    finally:
        server.stop()
