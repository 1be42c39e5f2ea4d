"""``orchestrator serve``: a small Tornado web app over the database (the source of truth).

Pages (server-rendered, no build step, nothing from a CDN):

* ``/runs`` - runs with filters (``tenant``, ``dag``, ``state``) and paging (``page``);
* ``/runs/RUN_ID`` - the run: its DAG drawn (:mod:`orchestrator.graph`), the task table with
  the reason each waiting task waits (:mod:`orchestrator.explain`), the ledger, and operator
  actions (retry / skip / fail a task, cancel the run) as POST forms with an XSRF token.

JSON for scripts (the pages' data, same addresses under ``/api``):

* ``GET /api/runs?tenant=&dag=&state=&limit=&offset=`` - ``{"runs": [...]}``;
* ``GET /api/runs/RUN_ID[?events=N]`` - ``{"run", "tasks", "edges", "waiting", "events"}`` (the
  newest ``N`` ledger rows, or all);
* ``GET /api/runs/RUN_ID/graph?format=svg|dot|mermaid`` - the picture;
* ``POST /api/runs/RUN_ID/cancel`` and ``POST /api/runs/RUN_ID/tasks/KEY/retry|skip|fail`` -
  ``{"ok": true, ...}``, or ``{"error": ...}`` with 400/403/404/409;
* ``GET /metrics`` - Prometheus text (:mod:`orchestrator.metrics`); ``GET /healthz``.

Tenants: the app shows and acts as its orchestrator does. Served by an orchestrator bound to a
tenant (``orchestrator --tenant T serve``, ``ORCHESTRATOR_TENANT``), every page, JSON document
and action of another tenant's run answers 404 exactly like a run that does not exist (the
orchestrator's reads and actions are scoped to the tenant in the store), the runs list holds the
tenant's runs only, and ``/metrics`` the tenant's families (not the deployment's workers).

Access (``ORCHESTRATOR_UI_AUTH``): ``user:password`` asks for HTTP basic authentication on
every address but ``/healthz``; a bare token is accepted as ``Authorization: Bearer TOKEN``
(scripts) or through the ``/login`` form (a signed cookie). Without it, the app acts (POST)
only when bound to a loopback address, and then only for requests whose ``Host`` names a
loopback host (a DNS-rebinding page cannot drive it); bound anywhere else it is read-only. A
browser POST always needs the XSRF token of the page it came from; a bearer-token request
needs none (a browser never sends that header by itself). Every action is recorded in the
ledger with who acted and from where: ``alice (web from 10.0.0.7)``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import ipaddress
import json
import logging
import math
import os
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

import tornado.web
from tornado.template import Loader

from . import graph as drawing
from .errors import (
    ConflictError,
    OperatorError,
    OrchestratorError,
    RunNotFound,
    TaskNotFound,
    ValidationError,
)
from .states import RunState, TaskState

if TYPE_CHECKING:
    from .engine import Orchestrator

log = logging.getLogger(__name__)

PAGE_SIZE = 50
#: the deepest page (an offset walks the index that far): filter by DAG, state or tenant instead
MAX_OFFSET = 100_000
#: ledger rows shown on the run page (all of them are in /api/runs/RUN_ID)
LEDGER_ROWS = 500
ACTIONS = ("retry", "skip", "fail")
#: headers a reverse proxy adds: without authentication, a relayed request is refused
PROXY_HEADERS = ("Forwarded", "X-Forwarded-For", "X-Forwarded-Host", "X-Real-Ip", "Via")


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (``127.0.0.1``, ``::1``, ``localhost``).
    An empty host, ``0.0.0.0`` and ``::`` listen on every interface: not loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Access:
    """Who may read and who may act, from ``ORCHESTRATOR_UI_AUTH`` and the bind address."""

    def __init__(self, auth: str, bind: str) -> None:
        self.user, self.password, self.token = "", "", ""
        if ":" in auth:
            self.user, self.password = auth.split(":", 1)
            if not self.user or not self.password:
                raise ValidationError("ORCHESTRATOR_UI_AUTH must be user:password (both non-empty) or a token")
        elif auth:
            if len(auth) < 16:
                raise ValidationError("ORCHESTRATOR_UI_AUTH token must be at least 16 characters")
            self.token = auth
        self.local = is_loopback(bind)

    @property
    def enabled(self) -> bool:
        return bool(self.password or self.token)

    @property
    def can_write(self) -> bool:
        """Actions need authentication, or a loopback bind (only local users reach it)."""
        return self.enabled or self.local

    def basic(self, header: str) -> str | None:
        """The user named by a valid ``Authorization: Basic`` header."""
        if not self.password or not header.startswith("Basic "):
            return None
        try:
            user, _, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        ok = hmac.compare_digest(user.encode(), self.user.encode()) & hmac.compare_digest(
            password.encode(), self.password.encode()
        )
        return user if ok else None

    def bearer(self, header: str) -> bool:
        return (
            bool(self.token)
            and header.startswith("Bearer ")
            and hmac.compare_digest(header[7:].strip().encode(), self.token.encode())
        )


class _Base(tornado.web.RequestHandler):
    """Authentication, the Host check, errors as HTML or JSON, and blocking calls off the loop."""

    api = False

    @property
    def orc(self) -> Orchestrator:
        return self.settings["orc"]  # type: ignore[no-any-return]

    @property
    def access(self) -> Access:
        return self.settings["access"]  # type: ignore[no-any-return]

    async def blocking(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.settings["pool"], lambda: fn(*args, **kwargs))

    def prepare(self) -> None:
        access = self.access
        if not access.enabled and access.local:
            host = self.request.host_name
            if not is_loopback(host):
                # a page on another origin resolving its name to 127.0.0.1 (DNS rebinding)
                raise tornado.web.HTTPError(403, reason=f"host {host!r} is not this machine's loopback name")
            relayed = [h for h in PROXY_HEADERS if h in self.request.headers]
            if relayed:
                # a reverse proxy would open the unauthenticated loopback app to whoever reaches it
                raise tornado.web.HTTPError(
                    403, reason=f"relayed request ({relayed[0]}): set ORCHESTRATOR_UI_AUTH to serve behind a proxy"
                )
        if not access.enabled or self.request.path in ("/healthz", "/login"):
            return
        if self.current_user is None:
            if access.password:
                raise tornado.web.HTTPError(401)  # write_error asks for the password
            if self.api or self.request.method != "GET":
                raise tornado.web.HTTPError(401)
            self.redirect("/login?" + urlencode({"next": self.request.uri or "/"}))  # finishes the request

    def get_current_user(self) -> str | None:
        access = self.access
        if not access.enabled:
            return "anonymous"
        header = self.request.headers.get("Authorization", "")
        if access.password:
            return access.basic(header)
        if access.bearer(header):
            return "token"
        cookie = self.get_signed_cookie("orc_user", max_age_days=1)
        return cookie.decode() if cookie else None

    def check_xsrf_cookie(self) -> None:
        if self.access.bearer(self.request.headers.get("Authorization", "")):
            return  # a browser never sends this header by itself: no forgery possible
        super().check_xsrf_cookie()

    def by(self) -> str:
        """Who acts, and from where, as the ledger records it."""
        user = self.current_user if self.access.enabled else "anonymous"
        return f"{user} (web from {self.request.remote_ip})"

    def require_write(self) -> None:
        if not self.access.can_write:
            raise tornado.web.HTTPError(
                403, reason="read-only: no ORCHESTRATOR_UI_AUTH and not bound to a loopback address"
            )

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        if status_code == 401 and self.access.password:
            self.set_header("WWW-Authenticate", 'Basic realm="orchestrator", charset="UTF-8"')
        exc = kwargs.get("exc_info", (None, None, None))[1]
        message = str(exc) if isinstance(exc, OrchestratorError) else (self._reason or "error")
        if isinstance(exc, tornado.web.HTTPError) and exc.reason:
            message = exc.reason
        if self.api:
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps({"error": message, "status": status_code}))
        else:
            self.finish(render("error.html", title=f"{status_code}", status=status_code, message=message, handler=self))

    def _handle_request_exception(self, e: BaseException) -> None:
        status = _status_of(e)
        if status is not None:
            self.set_status(status)
            self.send_error(status, exc_info=(type(e), e, e.__traceback__))
            return
        super()._handle_request_exception(e)


def _status_of(exc: BaseException) -> int | None:
    if isinstance(exc, RunNotFound | TaskNotFound):
        return 404
    if isinstance(exc, ConflictError):
        return 409
    if isinstance(exc, ValidationError | OperatorError):
        return 400
    if isinstance(exc, OrchestratorError):
        return 500
    return None


def _filters(handler: _Base) -> dict[str, Any]:
    state = handler.get_query_argument("state", "") or None
    if state is not None:
        try:
            RunState(state.upper())
        except ValueError:
            raise ValidationError(f"unknown run state {state!r}; one of {', '.join(RunState)}") from None
    return {
        "tenant": handler.get_query_argument("tenant", "") or None,
        "dag": handler.get_query_argument("dag", "") or None,
        "state": state,
    }


def _int_arg(handler: _Base, name: str, default: int, low: int, high: int) -> int:
    raw = handler.get_query_argument(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        raise ValidationError(f"{name} must be a whole number, not {raw!r}") from None
    if not low <= value <= high:
        raise ValidationError(f"{name} must be between {low} and {high}")
    return value


def run_document(orc: Orchestrator, run_id: str, *, events: int | None = None) -> dict[str, Any]:
    """Everything the run page shows, as JSON: the run, its tasks, edges, why the waiting
    tasks wait, and the ledger (the newest ``events`` rows, or all)."""
    view = orc.visible(run_id)
    tasks = orc.tasks(run_id)
    waiting: dict[str, Any] = {}
    if any(not t.state.terminal and t.state is not TaskState.RUNNING for t in tasks):
        waiting = {
            e.key: [r.to_json() for r in e.reasons]
            for e in orc.explain(run_id)
            if not e.state.terminal and e.state is not TaskState.RUNNING
        }
    ledger = orc.events(run_id, newest=events)
    return {
        "run": view.to_json(),
        "tasks": [t.to_json() for t in tasks],
        "edges": [list(e) for e in orc.edges(run_id)],
        "waiting": waiting,
        "events": [e.to_json() for e in ledger],
    }


def run_page_data(orc: Orchestrator, run_id: str) -> tuple[dict[str, Any], str]:
    """The run page's document and its SVG, built off the IO loop (one read of the tasks)."""
    doc = run_document(orc, run_id, events=LEDGER_ROWS)
    tasks = [drawing.TaskInfo(t["key"], t["task"], t["state"], t["trigger_rule"], t["attempt"]) for t in doc["tasks"]]
    picture = drawing.layout(tasks, [(p, c) for p, c in doc["edges"]])
    return doc, drawing.to_svg(picture, href=lambda key: f"#task-{quote(key)}")


def safe_next(target: str) -> str:
    """Where the login form may send the browser: a path of this app, nothing else."""
    from urllib.parse import urlsplit

    parts = urlsplit(target)
    if (
        not target.startswith("/")
        or target.startswith("//")
        or "\\" in target
        or any(ord(ch) < 0x20 for ch in target)
        or parts.scheme
        or parts.netloc
    ):
        return "/runs"
    return target


def run_graph(orc: Orchestrator, run_id: str) -> drawing.Graph:
    return drawing.from_views(orc.tasks(run_id), orc.edges(run_id))


class Home(_Base):
    def get(self) -> None:
        self.redirect("/runs")


class Health(_Base):
    def get(self) -> None:
        self.write("ok\n")


class Login(_Base):
    def get(self) -> None:
        self.write(
            render(
                "login.html", title="Log in", handler=self, next=self.get_query_argument("next", "/runs"), failed=False
            )
        )

    def post(self) -> None:
        token = self.get_body_argument("token", "")
        target = safe_next(self.get_body_argument("next", "/runs"))
        if not self.access.token or not hmac.compare_digest(token.encode(), self.access.token.encode()):
            self.set_status(401)
            self.write(render("login.html", title="Log in", handler=self, next=target, failed=True))
            return
        self.set_signed_cookie("orc_user", "token", expires_days=1, httponly=True, samesite="Strict")
        self.redirect(target)


class RunsPage(_Base):
    async def get(self) -> None:
        filters = _filters(self)
        page = _int_arg(self, "page", 1, 1, MAX_OFFSET // PAGE_SIZE)
        views = await self.blocking(self.orc.runs, PAGE_SIZE + 1, offset=(page - 1) * PAGE_SIZE, **filters)
        more = len(views) > PAGE_SIZE

        def link(p: int) -> str:
            return "/runs?" + urlencode({**{k: v for k, v in filters.items() if v}, "page": p})

        self.write(
            render(
                "runs.html",
                title="Runs",
                handler=self,
                runs=views[:PAGE_SIZE],
                filters=filters,
                states=list(RunState),
                page=page,
                prev=link(page - 1) if page > 1 else None,
                next=link(page + 1) if more else None,
            )
        )


class RunPage(_Base):
    async def get(self, run_id: str) -> None:
        doc, svg = await self.blocking(run_page_data, self.orc, run_id)
        done = self.get_signed_cookie("orc_done", max_age_days=1)
        if done is not None:
            self.clear_cookie("orc_done")
        self.write(
            render(
                "run.html",
                title=f"Run {run_id}",
                handler=self,
                doc=doc,
                svg=svg,
                final=RunState(doc["run"]["state"]).terminal,
                colours=drawing.COLOURS,
                done=done.decode() if done else "",
                ledger_rows=LEDGER_ROWS,
            )
        )


class _Act(_Base):
    async def act(self, run_id: str, key: str | None, action: str) -> str:
        self.require_write()
        by = self.by()
        if key is None:
            revoked = await self.blocking(self.orc.cancel, run_id, by=by)
            return f"run cancelled; {revoked} task(s) revoked"
        fn = {"retry": self.orc.retry_task, "skip": self.orc.skip_task, "fail": self.orc.fail_task}[action]
        await self.blocking(fn, run_id, key, by=by)
        return f"{key}: {action} done"


class RunAction(_Act):
    async def post(self, run_id: str, key: str | None = None, action: str = "cancel") -> None:
        done = await self.act(run_id, key, action)
        # the outcome travels in a signed one-time cookie: a link cannot put words in the banner
        self.set_signed_cookie("orc_done", done, expires_days=None, httponly=True, samesite="Strict")
        self.redirect(f"/runs/{quote(run_id)}", status=303)


class ApiRuns(_Base):
    api = True

    async def get(self) -> None:
        limit = _int_arg(self, "limit", PAGE_SIZE, 1, 1000)
        offset = _int_arg(self, "offset", 0, 0, MAX_OFFSET)
        views = await self.blocking(self.orc.runs, limit, offset=offset, **_filters(self))
        self.write({"runs": [v.to_json() for v in views], "limit": limit, "offset": offset})


class ApiRun(_Base):
    api = True

    async def get(self, run_id: str) -> None:
        newest = _int_arg(self, "events", 0, 0, 1_000_000) or None  # 0 (default): the whole ledger
        self.write(await self.blocking(run_document, self.orc, run_id, events=newest))


class ApiGraph(_Base):
    api = True

    async def get(self, run_id: str) -> None:
        fmt = self.get_query_argument("format", "svg")
        if fmt not in drawing.FORMATS:
            raise ValidationError(f"format must be one of {', '.join(drawing.FORMATS)}, not {fmt!r}")
        picture = await self.blocking(run_graph, self.orc, run_id)
        kinds = {"svg": "image/svg+xml", "dot": "text/vnd.graphviz", "mermaid": "text/plain"}
        self.set_header("Content-Type", f"{kinds[fmt]}; charset=utf-8")
        self.write(drawing.FORMATS[fmt](picture))


class ApiAction(_Act):
    api = True

    async def post(self, run_id: str, key: str | None = None, action: str = "cancel") -> None:
        done = await self.act(run_id, key, action)
        self.write({"ok": True, "run": run_id, "key": key, "action": action, "done": done})


class Metrics(_Base):
    async def get(self) -> None:
        from .metrics import render as render_metrics

        body, content_type = await self.blocking(render_metrics, self.orc, accept=self.request.headers.get("Accept"))
        self.set_header("Content-Type", content_type)
        self.write(body)


RUN_ID = r"([A-Za-z0-9_-]{1,32})"
KEY = r"([A-Za-z0-9_-]{1,200})"
VERB = r"(retry|skip|fail)"


def make_app(orc: Orchestrator, *, auth: str = "", bind: str = "127.0.0.1", cookie_secret: str | None = None) -> Any:
    """The Tornado application (tests drive it directly; :func:`serve` listens)."""
    access = Access(auth, bind)
    return tornado.web.Application(
        [
            (r"/", Home),
            (r"/healthz", Health),
            (r"/login", Login),
            (r"/metrics", Metrics),
            (r"/runs/?", RunsPage),
            (rf"/runs/{RUN_ID}", RunPage),
            (rf"/runs/{RUN_ID}/cancel", RunAction),
            (rf"/runs/{RUN_ID}/tasks/{KEY}/{VERB}", RunAction),
            (r"/api/runs/?", ApiRuns),
            (rf"/api/runs/{RUN_ID}", ApiRun),
            (rf"/api/runs/{RUN_ID}/graph", ApiGraph),
            (rf"/api/runs/{RUN_ID}/cancel", ApiAction),
            (rf"/api/runs/{RUN_ID}/tasks/{KEY}/{VERB}", ApiAction),
        ],
        orc=orc,
        access=access,
        pool=ThreadPoolExecutor(max_workers=4, thread_name_prefix="orc-web"),
        xsrf_cookies=True,
        xsrf_cookie_kwargs={"httponly": True, "samesite": "Strict"},
        cookie_secret=cookie_secret or secrets.token_hex(32),
        autoescape="xhtml_escape",
    )


def serve(
    orc: Orchestrator, *, host: str, port: int, auth: str = "", ready: Callable[[str], None] | None = None
) -> None:
    """Listen on ``host:port`` until interrupted."""
    import tornado.ioloop

    access = Access(auth, host)
    app = make_app(orc, auth=auth, bind=host)
    server = app.listen(port, address=host)
    mode = (
        "authentication required"
        if access.enabled
        else ("no authentication (loopback only)" if access.local else "read-only (no ORCHESTRATOR_UI_AUTH)")
    )
    shown = f"[{host}]" if ":" in host else (host or "0.0.0.0")
    if ready is not None:
        ready(f"serving on http://{shown}:{port}/runs - {mode}; pid {os.getpid()}")
    try:
        tornado.ioloop.IOLoop.current().start()
    finally:
        server.stop()


# ------------------------------------------------------------------ templates (orchestrator/templates)


TEMPLATES = Loader(str(Path(__file__).parent / "templates"), autoescape="xhtml_escape")


def render(name: str, **values: Any) -> bytes:
    handler = values["handler"]
    return TEMPLATES.load(name).generate(
        xsrf=handler.xsrf_form_html,
        quote=quote,
        user=handler.current_user if handler.access.enabled else None,
        can_write=handler.access.can_write,
        ceil=math.ceil,
        **values,
    )
