"""``orchestrator serve``: a small Tornado web app over the database (the source of truth).

Pages (server-rendered, no build step, nothing from a CDN):

* ``/runs`` - runs with filters (``tenant``, ``dag``, ``state``) and paging (``page``);
* ``/runs/RUN_ID`` - the run: its DAG drawn (:mod:`orchestrator.core.graph`; a big one in counted
  groups), the task table (paged, with a state filter and a key search) with the reason each
  waiting task waits (:mod:`orchestrator.core.explain`), the ledger (paged), and operator
  actions as POST forms with an XSRF token: retry / skip / fail a task, clear it (with its
  downstream or not) or mark it success / failed / skipped, cancel the run or rerun it (a new
  run, linked to it, whose page the browser goes on to). A refused action answers its error
  page (400 / 404 / 409 with the reason): a refused clear, mark or rerun writes nothing (a
  refused retry, skip, fail or cancel leaves its refusal in the ledger). A map
  is one box counting its children (``resize \u00d710,000 · 9,990 ok · 10 failed``); a click on it
  draws its children (``/runs/RUN_ID?part=map&key=KEY``, the first :data:`MAP_CELLS`); a map
  child's key (``resize[3]``) pages, searches and acts like any other (URL-encoded in paths).

JSON for scripts (the pages' data, same addresses under ``/api``):

* ``GET /api/runs?tenant=&dag=&state=&limit=&offset=`` - ``{"runs": [...]}``;
* ``GET /api/runs/RUN_ID?limit=&after=&before=&state=&q=&events=&events_before=&edges_after=`` -
  ``{"run", "counts", "tasks", "edges", "waiting", "events", "page", "next"}``, paged: 500 tasks
  (by key), edges and ledger rows unless told otherwise, ``next`` the links to the next pages;
* ``GET /api/runs/RUN_ID/changes?after=EVENT_ID`` - what changed since a ledger id (the run page
  polls it instead of reloading);
* ``GET /api/runs/RUN_ID/graph?format=svg|dot|mermaid`` - the picture;
* ``POST /api/runs/RUN_ID/cancel|rerun`` and ``POST /api/runs/RUN_ID/tasks/KEY/retry|skip|fail|clear|mark``
  (``clear``: ``downstream=1`` to clear the task's descendants too; ``mark``:
  ``state=success|failed|skipped``, as form fields or query parameters) - ``{"ok": true, ...}``
  (a clear adds ``cleared``, the keys; a mark ``was``, the state the task held; a rerun
  ``rerun``, the new run's id, and ``url``, its page), or ``{"error": ...}`` with 400/403/404/409;
* ``GET /metrics`` - Prometheus text (:mod:`orchestrator.web.metrics`); ``GET /healthz``.

Tenants: the app shows and acts as its orchestrator does. Served by an orchestrator bound to a
tenant (``orchestrator --tenant T serve``, ``ORCHESTRATOR_TENANT``), every page, JSON document
and action of another tenant's run answers 404 exactly like a run that does not exist (the
orchestrator's reads and actions are scoped to the tenant in the store), the runs list holds the
tenant's runs only, and ``/metrics`` the tenant's families (not the deployment's workers).

Access (``ORCHESTRATOR_UI_AUTH``): every read and write needs authentication, on any bind
(only ``/healthz`` answers without it, and says nothing but ``ok``). The setting is a
comma-separated list of credentials, each ``user:password`` (HTTP basic) or a token of 16+
characters (``Authorization: Bearer TOKEN`` for scripts; ``/login?token=TOKEN`` or the
``/login`` form for people: a signed session cookie), optionally bound to a tenant with
``=TENANT`` (``=*`` or nothing: every tenant). A tenant-bound credential acts as an
orchestrator bound to that tenant: another tenant's run is 404 everywhere, lists and
``/metrics`` hold its tenant only. Unset, ``serve`` on a loopback address makes a random token
at start and prints its login URL (Jupyter's model); on any other address it refuses to start.
No request header (``Host``, ``X-Forwarded-For``, ...) grants or denies anything: credentials
decide. A browser POST always needs the XSRF token of the page it came from; a bearer-token
request needs none (a browser never sends that header by itself). Every action is recorded in
the ledger with who acted and from where: ``alice (web from 10.0.0.7)``. Wrong credentials, on
every way in, are rate-limited per client and in total (:class:`LoginLimiter`: 429 with
``Retry-After``; the total limit never refuses a right credential); ``/login?token=`` logs in
directly only from a typed or same-origin navigation (``Sec-Fetch-Site``), else it shows the
form; ``POST /logout`` clears the session; cookies are ``Secure`` over TLS or behind a TLS proxy
(``ORCHESTRATOR_UI_BEHIND_TLS_PROXY``, ``serve --behind-tls-proxy``); on a bind that is not
loopback a basic-auth password needs :data:`MIN_PASSWORD_CHARS` characters.

Every response carries a Content-Security-Policy (scripts of this origin, or inline ones with
the page's nonce only), ``X-Frame-Options: DENY``, ``nosniff``, ``Referrer-Policy:
same-origin`` and ``Cache-Control: no-store``. A browser's POST from another origin (another
port of this host included) is refused by its ``Origin`` / ``Sec-Fetch-Site``. A URL longer
than :data:`MAX_URL_BYTES` is answered 414, headers larger than :data:`MAX_HEADER_BYTES` 431.
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
import re
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode, urlsplit

import tornado.web
from tornado.log import access_log
from tornado.template import Loader

from ..core import graph as drawing
from ..core.dag import KEY_RE, TENANT_RE, parse_spec
from ..core.errors import (
    ConfigurationError,
    ConflictError,
    OperatorError,
    OrchestratorError,
    RunNotFound,
    SpecError,
    TaskNotFound,
    ValidationError,
)
from ..core.explain import mapped_text
from ..core.states import RunState, TaskState

if TYPE_CHECKING:
    from ..engine.facade import Orchestrator

log = logging.getLogger(__name__)

PAGE_SIZE = 50
#: the deepest page (an offset walks the index that far): filter by DAG, state or tenant instead
MAX_OFFSET = 100_000
#: ledger rows per page of the run page (older pages: ``?events_before=ID``)
LEDGER_ROWS = 100
#: task rows per page of the run page's table (``?limit=``, at most MAX_LIMIT)
TASK_ROWS = 100
#: tasks, edges and ledger rows per page of ``/api/runs/RUN_ID`` unless ``limit`` / ``events`` say otherwise
API_LIMIT = 500
#: the most tasks or edges one page may ask for
MAX_LIMIT = 1000
#: the most ledger rows one page (``events=N``) may ask for
MAX_EVENTS = 5000
#: the most ledger rows ``/api/runs/RUN_ID/changes`` answers at once (``more`` says when more wait)
CHANGES_LIMIT = 500
#: how many runs' drawing skeletons (:class:`orchestrator.graph.Skeleton`) a server keeps
SKELETONS = 4
#: the run page's script (served at /static/run.js)
RUN_SCRIPT = Path(__file__).parent / "static" / "run.js"
ACTIONS = ("retry", "skip", "fail", "clear", "mark", "approve", "reject")
#: what a mark may set (the form's ``state``): the page's words, and the states' own names
MARKS = {"success": TaskState.SUCCEEDED, "failed": TaskState.FAILED, "skipped": TaskState.SKIPPED}
#: the most cleared keys a clear's banner names (the JSON answer holds them all)
CLEARED_SHOWN = 10
#: the longest URL (request target) answered: longer is 414
MAX_URL_BYTES = 8 * 1024
#: the most bytes of request headers answered: more is 431
MAX_HEADER_BYTES = 32 * 1024
#: Tornado's own limit on the request line and headers together, raised well above the two
#: limits above so such a request is read and answered 414/431; beyond it Tornado closes the
#: connection without a status
#: connection; a request body (the forms hold an XSRF token, a token and a path) is at most
#: 64 KiB, read within 30 s, and an idle connection is closed after 5 minutes
SERVER_OPTIONS: dict[str, Any] = {
    "max_header_size": 1024 * 1024,
    "max_body_size": 64 * 1024,
    "body_timeout": 30.0,
    "idle_connection_timeout": 300.0,
}
#: the session cookie set by a token login (its value: the credential's name, signed)
SESSION_COOKIE = "orc_user"
#: a basic-auth password shorter than this is refused on a bind that is not loopback
MIN_PASSWORD_CHARS = 12


class LoginLimiter:
    """Wrong credentials, counted per client and in total (token buckets refilled over
    ``window`` seconds): every way a credential comes in (the login form, ``/login?token=``,
    ``Authorization: Bearer`` and ``Basic``) goes through :meth:`locked` before it is checked and
    :meth:`failed` when it was wrong.

    * A client (its address; an IPv6 client's /64 network) with ``per_client`` wrong attempts
      in the window is answered 429 with ``Retry-After`` before anything is checked, right or
      wrong: a guess from it says nothing. Other clients are not affected.
    * Past ``total`` wrong attempts in the window from all clients together, a wrong attempt
      is answered 429 (``Retry-After``) after ``delay`` seconds; a right credential still
      passes, so many guessing clients slow each other down but never lock the owner out.

    At most ``clients`` addresses are remembered (the ones with the fewest failures go first).
    ``clock`` is injected for tests. Used on the IO loop only (a lock keeps it safe anyway)."""

    def __init__(
        self,
        *,
        per_client: int = 10,
        total: int = 100,
        window: float = 60.0,
        delay: float = 1.0,
        clients: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_client, self.total, self.window, self.delay = per_client, total, window, delay
        self.clients = clients
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, at)
        self._all = (float(total), clock())
        self._lock = threading.Lock()

    @staticmethod
    def client_of(address: str | None) -> str:
        """The client an address counts as: itself, or an IPv6 address's /64 network (one
        host holds a whole /64)."""
        try:
            ip = ipaddress.ip_address(address or "")
        except ValueError:
            return address or "?"
        if isinstance(ip, ipaddress.IPv6Address):
            if ip.ipv4_mapped is not None:
                return str(ip.ipv4_mapped)
            return str(ipaddress.ip_network(f"{ip}/64", strict=False))
        return str(ip)

    def _refill(self, bucket: tuple[float, float], size: int, now: float) -> float:
        tokens, at = bucket
        return min(float(size), tokens + (now - at) * size / self.window)

    def _wait(self, tokens: float, size: int) -> float:
        return 0.0 if tokens >= 1 else max(1.0, (1 - tokens) * self.window / size)

    def locked(self, client: str) -> float:
        """Seconds until ``client`` may try a credential again (0: now)."""
        with self._lock:
            found = self._buckets.get(client)
            if found is None:
                return 0.0
            return self._wait(self._refill(found, self.per_client, self.clock()), self.per_client)

    def failed(self, client: str) -> float:
        """Count a wrong credential of ``client``; the seconds until the total budget has room
        again (0: it has)."""
        with self._lock:
            now = self.clock()
            found = self._buckets.pop(client, None)
            tokens = self._refill(found, self.per_client, now) if found else float(self.per_client)
            self._buckets[client] = (tokens - 1, now)  # the newest last
            if len(self._buckets) > self.clients:
                fullest = max(self._buckets, key=lambda c: self._refill(self._buckets[c], self.per_client, now))
                self._buckets.pop(fullest)
            had = self._refill(self._all, self.total, now)
            self._all = (max(had - 1, -float(self.total)), now)
            return self._wait(had, self.total)


class TooManyAttempts(tornado.web.HTTPError):
    """429: too many wrong credentials; ``retry_after`` seconds until the next try counts."""

    def __init__(self, retry_after: float, reason: str) -> None:
        super().__init__(429, reason=reason)
        self.retry_after = max(1, math.ceil(retry_after))


def log_request(handler: tornado.web.RequestHandler) -> None:
    """The access log line, without the query string (a login URL carries its token) and with
    the path cut to 200 characters (a 414's URL is up to a megabyte)."""
    status = handler.get_status()
    log_method = access_log.info if status < 400 else access_log.warning if status < 500 else access_log.error
    request = handler.request
    path = request.path if len(request.path) <= 200 else request.path[:200] + "…"
    log_method("%d %s %s (%s) %.2fms", status, request.method, path, request.remote_ip, 1000 * request.request_time())


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (``127.0.0.1``, ``::1``, ``localhost``).
    An empty host, ``0.0.0.0`` and ``::`` listen on every interface: not loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Credential:
    """One entry of ``ORCHESTRATOR_UI_AUTH``: a user's password (``basic``) or a token."""

    kind: str  # "basic" or "token"
    #: who acts, as the ledger records it: the user, or ``token`` / ``token@TENANT``
    name: str
    secret: str = field(repr=False)
    #: the tenant it sees and acts on; ``None``: every tenant (an admin)
    tenant: str | None = None


def _refuse(message: str) -> ConfigurationError:
    return ConfigurationError(f"ORCHESTRATOR_UI_AUTH {message}")


def parse_ui_auth(raw: str) -> tuple[Credential, ...]:
    """The credentials of ``ORCHESTRATOR_UI_AUTH``: comma-separated entries, each
    ``user:password`` or a token (16+ characters, no spaces), optionally followed by
    ``=TENANT`` (bound to that tenant) or ``=*`` (every tenant, as without ``=``). Spaces
    around entries are ignored; a secret containing ``=`` must end with ``=*`` or ``=TENANT``,
    and none may contain ``,``. Raises :class:`ConfigurationError` naming the bad entry by its
    position (and user), never echoing a secret."""
    if raw == "":
        return ()
    if not raw.strip():
        raise _refuse("is blank: set credentials, or leave it unset on a loopback bind")
    found: list[Credential] = []
    names: set[str] = set()
    for i, part in enumerate(raw.split(","), 1):
        entry = part.strip()
        where = f"entry {i}"
        if not entry:
            raise _refuse(f"{where} is empty (entries are separated by ',')")
        tenant: str | None = None
        if "=" in entry:
            entry, _, bound = entry.rpartition("=")
            bound = bound.strip()
            if bound != "*":
                if not TENANT_RE.fullmatch(bound):
                    raise _refuse(
                        f"{where}: what follows its last '=' is neither '*' nor a tenant name (1-64 letters,"
                        " digits, '_' or '-'); a secret containing '=' must end with =* or =TENANT"
                    )
                tenant = bound
        if ":" in entry:
            user, _, password = entry.partition(":")
            if not user.strip() or user != user.strip():
                raise _refuse(f"{where}: the user name is empty or has spaces around it")
            where += f" (user {user!r})"
            if not password.strip():
                raise _refuse(f"{where}: the password is blank")
            if user in names:
                raise _refuse(f"{where}: the user appears twice")
            found.append(Credential("basic", user, password, tenant))
            names.add(user)
        else:
            where += " (a token)"
            if not entry.strip():
                raise _refuse(f"{where}: the token is blank")
            if any(ch.isspace() for ch in entry):
                raise _refuse(f"{where}: a token has no spaces")
            if len(entry) < 16:
                raise _refuse(f"{where}: a token must be at least 16 characters")
            name = "token" if tenant is None else f"token@{tenant}"
            n = 1
            while name in names:
                n += 1
                name = ("token" if tenant is None else f"token@{tenant}") + f"#{n}"
            found.append(Credential("token", name, entry, tenant))
            names.add(name)
    return tuple(found)


def _same(given: str, secret: str) -> bool:
    return hmac.compare_digest(given.encode(), secret.encode())


class Access:
    """Who may read and act: the credentials of ``ORCHESTRATOR_UI_AUTH``; unset, a token made
    now on a loopback bind (:attr:`generated`), and a refusal on any other bind. On a bind that
    is not loopback a basic-auth password shorter than :data:`MIN_PASSWORD_CHARS` is refused
    too (:class:`ConfigurationError`, naming the entry and user, never the password)."""

    def __init__(self, auth: str, bind: str) -> None:
        self.credentials = parse_ui_auth(auth)
        self.local = is_loopback(bind)
        #: the token made at start when no credentials are configured (loopback only)
        self.generated = ""
        if not self.credentials:
            if not self.local:
                shown = bind or "0.0.0.0"
                raise ConfigurationError(
                    f"ORCHESTRATOR_UI_AUTH is not set: serve refuses to bind {shown} (not a loopback"
                    " address) without credentials"
                )
            self.generated = secrets.token_urlsafe(32)
            self.credentials = (Credential("token", "token", self.generated),)
        if not self.local:
            for i, c in enumerate(self.credentials, 1):
                if c.kind == "basic" and len(c.secret) < MIN_PASSWORD_CHARS:
                    raise _refuse(
                        f"entry {i} (user {c.name!r}): a password must be at least {MIN_PASSWORD_CHARS}"
                        f" characters when serve binds {bind or '0.0.0.0'} (not a loopback address)"
                    )
        self.by_name = {c.name: c for c in self.credentials}

    @property
    def has_basic(self) -> bool:
        return any(c.kind == "basic" for c in self.credentials)

    @property
    def has_token(self) -> bool:
        return any(c.kind == "token" for c in self.credentials)

    @property
    def tenants(self) -> set[str]:
        return {c.tenant for c in self.credentials if c.tenant is not None}

    def basic(self, header: str) -> Credential | None:
        """The credential of a valid ``Authorization: Basic`` header."""
        if not header.startswith("Basic "):
            return None
        try:
            user, _, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        found = None
        for c in self.credentials:  # every entry compared: the time says nothing of which matched
            if c.kind == "basic" and _same(user, c.name) & _same(password, c.secret):
                found = c
        return found

    def token(self, given: str) -> Credential | None:
        """The credential of a token (from a Bearer header, ``/login?token=`` or the form)."""
        found = None
        for c in self.credentials:
            if c.kind == "token" and _same(given, c.secret):
                found = c
        return found if given else None

    def bearer(self, header: str) -> Credential | None:
        return self.token(header[7:].strip()) if header.startswith("Bearer ") else None


def content_security_policy(nonce: str) -> str:
    return (
        f"default-src 'none'; script-src 'self' 'nonce-{nonce}'; style-src 'self' 'unsafe-inline';"
        " img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none';"
        " base-uri 'none'"
    )


class _Base(tornado.web.RequestHandler):
    """Request limits, authentication, security headers, errors as HTML or JSON, and blocking
    calls off the loop."""

    api = False
    #: a person's page: without a session, a GET goes to the login form (else: 401)
    page = True
    #: where an error page links back to (an action's run), besides the runs list
    back: str | None = None
    #: the request was authenticated by an ``Authorization: Bearer`` token (no XSRF needed)
    _bearer = False

    @property
    def orc(self) -> Orchestrator:
        """The orchestrator of the logged-in credential: bound to its tenant, or the app's."""
        cred = self.current_user
        if cred is None:
            raise tornado.web.HTTPError(401)
        if cred.tenant is None:
            return self.settings["orc"]  # type: ignore[no-any-return]
        return self.settings["tenant_orcs"][cred.tenant]  # type: ignore[no-any-return]

    @property
    def access(self) -> Access:
        return self.settings["access"]  # type: ignore[no-any-return]

    @property
    def nonce(self) -> str:
        """This response's CSP nonce: ``<script nonce="{{ nonce }}">`` runs, no other inline script."""
        found: str | None = getattr(self, "_csp_nonce", None)
        if found is None:
            found = self._csp_nonce = secrets.token_urlsafe(16)
        return found

    def set_default_headers(self) -> None:
        self.set_header("Content-Security-Policy", content_security_policy(self.nonce))
        self.set_header("X-Frame-Options", "DENY")
        self.set_header("X-Content-Type-Options", "nosniff")
        # same-origin, not no-referrer: under no-referrer a browser sends `Origin: null` with a
        # form's POST, and the origin check of every cookie-authenticated POST needs the origin
        self.set_header("Referrer-Policy", "same-origin")
        self.set_header("Cache-Control", "no-store")

    async def blocking(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.settings["pool"], lambda: fn(*args, **kwargs))

    def _check_size(self) -> None:
        request = self.request
        if len(request.uri or "") > MAX_URL_BYTES:
            raise tornado.web.HTTPError(414, reason=f"URL longer than {MAX_URL_BYTES} bytes")
        if sum(len(k) + len(v) + 4 for k, v in request.headers.get_all()) > MAX_HEADER_BYTES:
            raise tornado.web.HTTPError(431, reason=f"request headers larger than {MAX_HEADER_BYTES} bytes")

    @property
    def limiter(self) -> LoginLimiter:
        return self.settings["limiter"]  # type: ignore[no-any-return]

    @property
    def secure_cookies(self) -> bool:
        """Whether cookies get ``Secure``: the request came over TLS (the connection's own
        protocol, never a header), or ``serve`` sits behind a TLS proxy (its option)."""
        return self.request.protocol == "https" or bool(self.settings.get("behind_tls_proxy"))

    async def prepare(self) -> None:
        request = self.request
        self._check_size()
        await self._authenticate()
        if request.method not in ("GET", "HEAD", "OPTIONS"):
            self._check_forgery()
        if request.path in ("/healthz", "/login", "/logout"):
            return
        if self.current_user is None:
            if (
                self.access.has_basic
                or self.api
                or not self.page
                or request.method != "GET"
                or not self.access.has_token
            ):
                raise tornado.web.HTTPError(401)  # write_error asks for the password
            self.redirect("/login?" + urlencode({"next": request.uri or "/"}))  # finishes the request

    async def _authenticate(self) -> None:
        """Who is asking: an ``Authorization`` header decides when there is one (checked
        through :meth:`attempt`, so wrong ones are rate-limited), else the session cookie."""
        access = self.access
        header = self.request.headers.get("Authorization", "")
        self._bearer = False
        if header.startswith("Basic "):
            self.current_user = await self.attempt(lambda: access.basic(header))
        elif header.startswith("Bearer "):
            self.current_user = await self.attempt(lambda: access.bearer(header))
            self._bearer = self.current_user is not None
        else:
            self.current_user = self.get_current_user()

    async def attempt(self, check: Callable[[], Credential | None]) -> Credential | None:
        """Check a presented credential under the :class:`LoginLimiter`: a client over its
        budget is refused (429) before the check, and past the total budget a wrong
        credential is answered 429 after a delay; a right one always passes."""
        limiter = self.limiter
        client = limiter.client_of(self.request.remote_ip)
        wait = limiter.locked(client)
        if wait:
            raise TooManyAttempts(wait, "too many wrong credentials from this address: try again later")
        found = check()
        if found is not None:
            return found
        busy = limiter.failed(client)
        if busy:
            await asyncio.sleep(limiter.delay)
            raise TooManyAttempts(busy, "too many wrong credentials: try again later")
        return None

    def get_current_user(self) -> Credential | None:
        """The session cookie's credential; a request with an ``Authorization`` header is
        authenticated by :meth:`prepare` (never here, so a wrong one is counted once)."""
        if self.request.headers.get("Authorization", "").startswith(("Basic ", "Bearer ")):
            return None
        cookie = self.get_signed_cookie(SESSION_COOKIE, max_age_days=1)
        return self.access.by_name.get(cookie.decode()) if cookie else None

    def check_xsrf_cookie(self) -> None:
        # Tornado checks XSRF before prepare(); prepare() does it (_check_forgery) after the
        # sizes and authentication, so a POST without credentials is 401 whatever its XSRF
        # token, and a wrong credential is counted before anything else is said
        pass

    def _check_forgery(self) -> None:
        if self.current_user is None and self.request.path not in ("/login", "/logout"):
            raise tornado.web.HTTPError(401)
        if getattr(self, "_bearer", False):
            return  # a browser never sends this header by itself: no forgery possible
        self._check_origin()
        super().check_xsrf_cookie()

    def _check_origin(self) -> None:
        """A browser's POST must come from this server's own pages. Cookies are scoped by host,
        not port: a page on another port of this host can plant an ``_xsrf`` cookie of its own
        choosing, so the double-submit check alone is not enough. Browsers send ``Origin`` and
        ``Sec-Fetch-Site`` with every POST: another origin is refused (403)."""
        headers = self.request.headers
        site = headers.get("Sec-Fetch-Site")
        if site is not None and site not in ("same-origin", "none"):
            raise tornado.web.HTTPError(403, reason="cross-site request refused")
        origin = headers.get("Origin")
        # the host and port only: behind a TLS-terminating proxy the scheme differs
        if origin is not None and urlsplit(origin).netloc != self.request.host:
            raise tornado.web.HTTPError(403, reason="request from another origin refused")

    def by(self) -> str:
        """Who acts, and from where, as the ledger records it."""
        cred = self.current_user
        return f"{cred.name if cred else 'anonymous'} (web from {self.request.remote_ip})"

    def require_write(self) -> None:
        if self.current_user is None:
            raise tornado.web.HTTPError(401)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        if status_code == 401 and self.access.has_basic:
            self.set_header("WWW-Authenticate", 'Basic realm="orchestrator", charset="UTF-8"')
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, TooManyAttempts):
            self.set_header("Retry-After", str(exc.retry_after))
        message = str(exc) if isinstance(exc, OrchestratorError) else (self._reason or "error")
        if isinstance(exc, tornado.web.HTTPError) and exc.reason:
            message = exc.reason
        if self.api:
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps({"error": message, "status": status_code}))
        else:
            self.finish(
                render(
                    "error.html", title=f"{status_code}", status=status_code, message=message, back=self.back,
                    handler=self,
                )
            )  # fmt: skip

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


@dataclass(frozen=True)
class TaskQuery:
    """A page of a run's tasks as asked: keyset cursors on the key, a state, a key search."""

    limit: int
    after: str | None = None
    before: str | None = None
    state: str | None = None
    search: str | None = None

    def params(self, default_limit: int) -> dict[str, str]:
        """The filters as query parameters (not the cursors)."""
        out = {"state": self.state or "", "q": self.search or ""}
        if self.limit != default_limit:
            out["limit"] = str(self.limit)
        return {k: v for k, v in out.items() if v}


#: a task's key: a node's (``KEY_RE``), or a map child's ``node[map key]`` (the map keys the
#: server accepts, ``orc_expand_v1``)
TASK_KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,200}(?:\[[A-Za-z0-9_.,:=-]{1,100}\])?")


def _task_query(handler: _Base, default_limit: int) -> TaskQuery:
    def key_arg(name: str) -> str | None:
        value = handler.get_query_argument(name, "") or None
        if value is not None and not TASK_KEY_RE.fullmatch(value):
            raise ValidationError(f"{name} must be a task key (letters, digits, '_' or '-'; a map's child: node[key])")
        return value

    state = handler.get_query_argument("state", "").strip().upper() or None
    if state is not None and state not in TaskState.__members__:
        raise ValidationError(f"unknown task state {state!r}; one of {', '.join(TaskState)}")
    search = handler.get_query_argument("q", "").strip() or None
    if search is not None and len(search) > 200:
        raise ValidationError("q (a key search) is at most 200 characters")
    return TaskQuery(
        limit=_int_arg(handler, "limit", default_limit, 1, MAX_LIMIT),
        after=key_arg("after"),
        before=key_arg("before"),
        state=state,
        search=search,
    )


def _opt_int(handler: _Base, name: str) -> int | None:
    raw = handler.get_query_argument(name, "")
    return None if raw == "" else _int_arg(handler, name, 0, 0, 2**62)


def _edge_cursor(handler: _Base) -> tuple[str, str] | None:
    raw = handler.get_query_argument("edges_after", "")
    if not raw:
        return None
    parent, _, child = raw.partition(".")
    if not (KEY_RE.fullmatch(parent) and KEY_RE.fullmatch(child)):
        raise ValidationError("edges_after must be PARENT.CHILD (two task keys)")
    return parent, child


def _event_json(event_id: int, event: Any) -> dict[str, Any]:
    return {"id": event_id, **event.to_json()}


def _waiting(orc: Orchestrator, run_id: str, tasks: list[Any]) -> dict[str, Any]:
    """Why each waiting task of ``tasks`` (not final, not running) waits."""
    keys = {t.key for t in tasks if not t.state.terminal and t.state is not TaskState.RUNNING}
    if not keys:
        return {}
    return {e.key: [r.to_json() for r in e.reasons] for e in orc.explain(run_id, keys=keys)}


def run_document(
    orc: Orchestrator,
    run_id: str,
    *,
    tasks: TaskQuery | None = None,
    events: int = API_LIMIT,
    events_before: int | None = None,
    edges_after: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """A run as JSON, paged: the run (with its tasks counted per state), one page of its tasks
    (``tasks``; the first :data:`API_LIMIT` keys by default) and why the waiting ones wait, as
    many of its edges, and ``events`` ledger rows (the newest, or those before the id
    ``events_before``), oldest first. ``page`` holds the cursors of the next pages."""
    reads = orc.reads
    tq = tasks or TaskQuery(API_LIMIT)
    view = orc.visible(run_id)
    page = reads.task_page(run_id, limit=tq.limit, after=tq.after, before=tq.before, state=tq.state, search=tq.search)
    edges, more_edges = reads.edge_page(run_id, limit=tq.limit, after=edges_after)
    ledger, older = reads.event_page(run_id, limit=events, before=events_before) if events else ([], False)
    if events_before is None and ledger:
        newest = ledger[-1][0]
    else:
        found, _ = reads.event_page(run_id, limit=1)
        newest = found[-1][0] if found else 0
    return {
        "run": view.to_json(),
        "counts": dict(sorted(view.counts.items())),
        "tasks": [t.to_json() for t in page.tasks],
        "edges": [list(e) for e in edges],
        "waiting": _waiting(orc, run_id, page.tasks),
        "events": [_event_json(i, e) for i, e in ledger],
        "page": {
            "limit": tq.limit,
            "tasks_after": page.tasks[-1].key if page.tasks and page.more_after else None,
            "tasks_before": page.tasks[0].key if page.tasks and page.more_before else None,
            "edges_after": ".".join(edges[-1]) if edges and more_edges else None,
            "events_before": ledger[0][0] if ledger and older else None,
            #: the run's newest ledger id: what changes after it, /api/runs/RUN_ID/changes?after=
            "last_event": newest,
        },
    }


class _SkeletonCache:
    """The drawing skeletons of the last :data:`SKELETONS` runs drawn, by (run, task count): a
    run's DAG never changes after submission, so a page load or a poll reads the tasks' states
    only (never the edges again). Every use is behind a read of the run that checks who may see
    it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._found: dict[tuple[str, int], drawing.Skeleton] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int]) -> drawing.Skeleton | None:
        with self._lock:
            found = self._found.pop(key, None)
            if found is not None:
                self._found[key] = found  # the newest last
            return found

    def knows(self, run_id: str) -> bool:
        """Whether a skeleton of ``run_id`` is kept (drawing it then costs one read of states)."""
        with self._lock:
            return any(k[0] == run_id for k in self._found)

    def put(self, key: tuple[str, int], skeleton: drawing.Skeleton) -> None:
        with self._lock:
            self._found[key] = skeleton
            while len(self._found) > self.size:
                self._found.pop(next(iter(self._found)))


SKELETON_CACHE = _SkeletonCache(SKELETONS)


def drawing_rows(
    orc: Orchestrator, run_id: str
) -> tuple[list[tuple[Any, ...]], dict[str, dict[str, int]], dict[str, str]]:
    """What the drawing needs: ``(key, task name, state, trigger rule, attempt)`` of every task
    that is not a map's child, each mapped node's children counted per state (in the database:
    a map of 100,000 children is a few rows here), and the SKIPPED tasks' reasons. Raises
    :class:`RunNotFound` for a run this caller does not see."""
    reads = orc.reads
    rows = reads._plain(
        run_id,
        "SELECT key, task_name, state, trigger_rule, attempt, skip_reason, map_spec IS NOT NULL"
        " FROM orc_tasks WHERE run_id = %(run)s AND map_parent IS NULL",
    )
    maps: dict[str, dict[str, int]] = {r[0]: {} for r in rows if r[6]}
    for parent, state, n in reads._plain(
        run_id,
        "SELECT map_parent, state, count(*) FROM orc_tasks WHERE run_id = %(run)s AND map_parent IS NOT NULL"
        " GROUP BY map_parent, state",
    ):
        maps.setdefault(parent, {})[state] = int(n)
    skipped = {r[0]: r[5] for r in rows if r[5]}
    return [r[:5] for r in rows], maps, skipped


def run_drawing(orc: Orchestrator, run_id: str) -> tuple[drawing.Skeleton, drawing.Graph]:
    """The run's DAG drawn (collapsed into counted groups when large, :func:`graph.structure`),
    from its tasks' states and its kept skeleton (the edges are read once per run). A map is
    one box counting its children (they have no edges, and the skeleton is made without them:
    a map growing does not change it)."""
    found, maps, skipped = drawing_rows(orc, run_id)  # RunNotFound for a run this caller does not see
    skeleton = SKELETON_CACHE.get((run_id, len(found)))
    if skeleton is None:
        skeleton = drawing.structure([r[0] for r in found], orc.reads.edge_list(run_id))
        SKELETON_CACHE.put((run_id, len(found)), skeleton)
    return skeleton, drawing.paint_rows(skeleton, found, maps=maps, skipped=skipped)


#: the most children of one map its expanded view (``?part=map&key=K``) draws
MAP_CELLS = 1000
CELL, CELLS_PER_ROW = 14, 50


def map_children(orc: Orchestrator, run_id: str, key: str, limit: int = MAP_CELLS) -> tuple[list[Any], int]:
    """The first ``limit`` children of the map ``key`` in map order ``(key, state, attempt,
    skip reason, map index, map key)`` and how many it has. Raises :class:`RunNotFound`, or
    :class:`TaskNotFound` when ``key`` is not a mapped node of the run."""
    from sqlalchemy import func, select

    from ..store.schema import tasks as t_tasks

    c = t_tasks.c
    reads = orc.reads
    head = reads._of_run(run_id, select(c.map_spec.isnot(None)).where(c.run_id == run_id, c.key == key))
    if not head or not head[0][0]:
        raise TaskNotFound(f"run {run_id!r} has no mapped task {key!r}")
    mine = [c.run_id == run_id, c.map_parent == key]
    total = int(reads._of_run(run_id, select(func.count()).where(*mine))[0][0])
    q = (
        select(c.key, c.state, c.attempt, c.skip_reason, c.map_index, c.map_key)
        .where(*mine)
        .order_by(c.map_index)
        .limit(limit)
    )
    return list(reads._of_run(run_id, q)), total


def map_svg(orc: Orchestrator, run_id: str, key: str) -> str:
    """A map's children drawn: one small square per child in map order, coloured by its state,
    each a link to its row of the task table (the first :data:`MAP_CELLS`; the task table lists
    them all)."""
    import html as markup

    children, total = map_children(orc, run_id, key)
    e = markup.escape
    rows = max(1, -(-len(children) // CELLS_PER_ROW))
    width, height = CELLS_PER_ROW * (CELL + 2) + 4, rows * (CELL + 2) + 24
    counts: dict[str, int] = {}
    cells = []
    for n, (k, state, attempt, skip, index, mkey) in enumerate(children):
        counts[state] = counts.get(state, 0) + 1
        x, y = 2 + (n % CELLS_PER_ROW) * (CELL + 2), 20 + (n // CELLS_PER_ROW) * (CELL + 2)
        why = f"; skipped: {skip}" if skip else ""
        link = f"?{urlencode({'q': k})}#task-{quote(k)}"
        cells.append(
            f'<g class="child" data-key="{e(k)}" data-state="{e(state)}" data-index="{index}">'
            f"<title>{e(k)}: {e(state)}{' #' + str(attempt) if attempt > 1 else ''}{e(why)} (item {index},"
            f' key {e(str(mkey))})</title><a href="{e(link)}"><rect x="{x}" y="{y}" width="{CELL}"'
            f' height="{CELL}" fill="{drawing.COLOURS.get(state, "#fff")}" stroke="#555"/></a></g>'
        )
    shown = f"{len(children):,} of {total:,} shown (the task table lists them all)" if total > len(children) else ""
    head_text = f"{key} \u00d7{total:,}: " + ", ".join(f"{n:,} {s.lower()}" for s, n in sorted(counts.items()))
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="map" data-map="{e(key)}" data-total="{total}"'
        f' width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" aria-label="map {e(key)}">'
        f'<text x="2" y="14" style="font:12px sans-serif">{e(head_text)} {e(shown)}</text>' + "".join(cells) + "</svg>"
    )


def run_page_data(
    orc: Orchestrator, run_id: str, tasks: TaskQuery, events_before: int | None
) -> tuple[dict[str, Any], str | None]:
    """The run page's document (one page of tasks, one of the ledger) and its SVG, built off
    the IO loop. The SVG is ``None`` when the run's skeleton is not kept yet and the run is
    large: laying out tens of thousands of tasks takes most of a second, so the page is served
    without it and its script fetches the drawing (``?part=dag``, :func:`run_dag_svg`)."""
    doc = run_document(orc, run_id, tasks=tasks, events=LEDGER_ROWS, events_before=events_before)
    doc.pop("edges")
    if sum(doc["counts"].values()) > DEFER_DRAWING_ABOVE and not SKELETON_CACHE.knows(run_id):
        return doc, None
    return doc, run_dag_svg(orc, run_id)


#: a run of more tasks whose skeleton is not kept is drawn after its page is served
DEFER_DRAWING_ABOVE = 2_000


def run_dag_svg(orc: Orchestrator, run_id: str) -> str:
    """The run page's drawing: the SVG, each task box a link to its row in the task table."""
    _, picture = run_drawing(orc, run_id)
    return drawing.to_svg(picture, href=lambda key: f"?{urlencode({'q': key})}#task-{quote(key)}")


def run_changes(orc: Orchestrator, run_id: str, after: int, limit: int) -> dict[str, Any]:
    """What changed in the run since the ledger id ``after``: at most ``limit`` new ledger rows
    (oldest first; ``more``: others wait, ask again from ``last``), the current state of every
    task they name, the run's state and counts per state, and the counts of the collapsed
    boxes of the drawing those tasks are in."""
    reads = orc.reads
    ledger, more = reads.event_page(run_id, limit=limit, after=after)
    view = orc.visible(run_id)
    keys = sorted({e.key for _, e in ledger if e.key is not None})
    tasks = reads.tasks_by_key(run_id, keys) if keys else []
    boxes: dict[str, Any] = {}
    skeleton = None
    if keys:
        skeleton, picture = run_drawing(orc, run_id)
        # a map's child has no box: its map's box counts it
        touched = {skeleton.box_of.get(t.map_parent or t.key) for t in tasks}
        boxes = {
            b.id: {"state": b.state, "counts": b.counts, "title": drawing.counted(b)}
            | ({"label": drawing.map_label(b), "sub": drawing.map_sub(b), "key": b.keys[0]} if b.mapped else {})
            for b in picture.boxes
            if (b.collapsed or b.mapped) and b.id in touched
        }
    return {
        "run": {"id": view.id, "state": view.state.value, "final": view.state.terminal},
        "counts": dict(sorted(view.counts.items())),
        "events": [_event_json(i, e) for i, e in ledger],
        "tasks": {
            t.key: {
                "state": t.state.value,
                "attempt": t.attempt,
                "max_attempts": t.max_attempts,
                "worker": t.worker,
                "duration": t.duration,
                "error": t.error[:300] if t.error and t.state is not TaskState.SUCCEEDED else None,
                "box": skeleton.box_of.get(t.map_parent or t.key) if skeleton else None,
                "skip_reason": t.skip_reason,
                "map": t.map_counts,
                "waiting": t.waiting,
            }
            for t in tasks
        },
        "boxes": boxes,
        "last": ledger[-1][0] if ledger else after,
        "more": more,
    }


def _flash(signed: bytes | None) -> dict[str, Any]:
    """The one-time banner an action left (its signed cookie): ``text``, and ``from``, the run a
    rerun repeats (``None`` otherwise). Nothing, or anything unreadable: no banner."""
    empty: dict[str, Any] = {"text": "", "from": None}
    if not signed:
        return empty
    try:
        found = json.loads(signed.decode())
    except (UnicodeDecodeError, ValueError):
        return empty
    if not isinstance(found, dict) or not isinstance(found.get("text"), str):
        return empty
    origin = found.get("from")
    return {"text": found["text"], "from": origin if isinstance(origin, str) else None}


def safe_next(target: str) -> str:
    """Where the login form may send the browser: a path of this app, nothing else."""
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
    return run_drawing(orc, run_id)[1]


class Home(_Base):
    def get(self) -> None:
        self.redirect("/runs")


class Health(_Base):
    def get(self) -> None:
        self.write("ok\n")


class Login(_Base):
    """``GET /login?token=TOKEN`` (the URL ``serve`` prints) and the form: a right token sets the
    session cookie and goes on to ``next`` (default ``/runs``); a wrong one sets nothing. Both are
    rate-limited (:class:`LoginLimiter`).

    The URL logs in directly only when the browser says it was typed, pasted or opened from
    outside a page (``Sec-Fetch-Site: none``) or came from this app (``same-origin``): a link on
    another site (or a client that says nothing) gets the login form with the token filled in,
    and the form's POST (XSRF token, same origin) logs in. So another site cannot log a browser
    in with a token of its choosing, nor use it to try tokens."""

    async def get(self) -> None:
        target = safe_next(self.get_query_argument("next", "/runs"))
        token = self.get_query_argument("token", None)
        if token is None:
            self.write(render("login.html", title="Log in", handler=self, next=target, failed=False, token=""))
            return
        if self.request.headers.get("Sec-Fetch-Site") not in ("none", "same-origin"):
            self.write(render("login.html", title="Log in", handler=self, next=target, failed=False, token=token))
            return
        cred = await self.attempt(lambda: self.access.token(token))
        if cred is None:
            raise tornado.web.HTTPError(403, reason="wrong token")
        self._log_in(cred, target)

    async def post(self) -> None:
        target = safe_next(self.get_body_argument("next", "/runs"))
        given = self.get_body_argument("token", "")
        cred = await self.attempt(lambda: self.access.token(given))
        if cred is None:
            self.set_status(401)
            self.write(render("login.html", title="Log in", handler=self, next=target, failed=True, token=""))
            return
        self._log_in(cred, target)

    def _log_in(self, cred: Credential, target: str) -> None:
        # Lax, not Strict: the login URL is opened from a terminal or a chat, and the redirect
        # that follows must carry the cookie; a cross-site POST is still stopped by the XSRF token
        self.set_signed_cookie(
            SESSION_COOKIE, cred.name, expires_days=1, httponly=True, samesite="Lax", secure=self.secure_cookies
        )
        self.redirect(target)


class Logout(_Base):
    """``POST /logout`` (XSRF token, same origin): clears the session cookie and goes to the
    login form. A browser keeps basic-auth passwords itself: only closing it forgets them."""

    def post(self) -> None:
        self.clear_cookie(SESSION_COOKIE, httponly=True, samesite="Lax", secure=self.secure_cookies)
        self.redirect("/login", status=303)


class NotFound(_Base):
    """Any other address: 404 (after authentication, with the security headers)."""

    async def prepare(self) -> None:
        self.api = self.request.path.startswith("/api/")  # an address under /api answers JSON
        await super().prepare()
        if not self._finished:
            raise tornado.web.HTTPError(404)


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
        if self.get_query_argument("part", "") == "dag":  # the drawing alone (a large run's page fetches it)
            svg = await self.blocking(run_dag_svg, self.orc, run_id)
            self.set_header("Content-Type", "image/svg+xml; charset=UTF-8")
            self.write(svg)
            return
        if self.get_query_argument("part", "") == "map":  # a map's children drawn (its box expanded)
            key = self.get_query_argument("key", "")
            if not KEY_RE.fullmatch(key):
                raise ValidationError("key must be a mapped task's key")
            svg = await self.blocking(map_svg, self.orc, run_id, key)
            self.set_header("Content-Type", "image/svg+xml; charset=UTF-8")
            self.write(svg)
            return
        tq = _task_query(self, TASK_ROWS)
        events_before = _opt_int(self, "events_before")
        doc, svg = await self.blocking(run_page_data, self.orc, run_id, tq, events_before)
        flash = self.get_signed_cookie("orc_done", max_age_days=1)
        if flash is not None:
            self.clear_cookie("orc_done")
        done = _flash(flash)
        here = f"/runs/{quote(run_id)}?"
        filters = tq.params(TASK_ROWS)
        page = doc["page"]

        def tasks_link(**cursor: str) -> str:
            return here + urlencode({**filters, **cursor}) + "#tasks"

        self.write(
            render(
                "run.html",
                title=f"Run {run_id}",
                handler=self,
                doc=doc,
                svg=svg,
                final=RunState(doc["run"]["state"]).terminal,
                colours=drawing.COLOURS,
                done=done["text"],
                done_from=done["from"],
                ledger_rows=LEDGER_ROWS,
                task_rows=TASK_ROWS,
                query=tq,
                task_states=list(TaskState),
                marks=[(word, state.value) for word, state in MARKS.items()],
                links={
                    "first": tasks_link() if tq.after or tq.before else None,
                    "next": tasks_link(after=page["tasks_after"]) if page["tasks_after"] else None,
                    "prev": tasks_link(before=page["tasks_before"]) if page["tasks_before"] else None,
                    "older": here + urlencode({**filters, "events_before": page["events_before"]}) + "#ledger"
                    if page["events_before"]
                    else None,
                    "newest": here + urlencode(filters) + "#ledger" if events_before is not None else None,
                },
            )
        )


def _flag(handler: _Base, name: str) -> bool:
    """A yes/no form field or query parameter (a checkbox sends ``on`` or its value; absent: no)."""
    raw = handler.get_argument(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValidationError(f"{name} must be 1 or 0 (true or false), not {raw[:40]!r}")


def _mark_state(handler: _Base) -> TaskState:
    raw = handler.get_argument("state", "").strip()
    found = MARKS.get(raw.lower())
    if found is None and raw.upper() in {s.value for s in MARKS.values()}:
        found = TaskState(raw.upper())
    if found is None:
        shown = f"not {raw[:40]!r}" if raw else "it is missing"
        raise ValidationError(f"a mark's state must be success, failed or skipped ({shown})")
    return found


@dataclass(frozen=True)
class Done:
    """An action's outcome: the banner's words, what the JSON answer adds, and the run whose page
    the browser goes on to (a rerun's new run; else the run acted on)."""

    text: str
    run_id: str
    extra: dict[str, Any] = field(default_factory=dict)


class _Act(_Base):
    """The run page's forms and the JSON API's POSTs: one action each, as the credential's
    orchestrator (its tenant's runs only), recorded with :meth:`by`."""

    async def act(self, run_id: str, key: str | None, action: str) -> Done:
        self.require_write()
        self.back = f"/runs/{quote(run_id)}"  # the error page links back to the run
        by = self.by()
        orc = self.orc
        if key is None and action == "rerun":
            handle = await self.blocking(orc.rerun, run_id)
            url = f"/runs/{quote(handle.id)}"
            return Done(f"new run {handle.id}: a rerun of {run_id}", handle.id, {"rerun": handle.id, "url": url})
        if key is None:
            revoked = await self.blocking(orc.cancel, run_id, by=by)
            return Done(f"run cancelled; {revoked} task(s) revoked", run_id)
        if action == "clear":
            downstream = _flag(self, "downstream")
            cleared: list[str] = await self.blocking(orc.clear, run_id, key, downstream=downstream, by=by)
            shown = ", ".join(cleared[:CLEARED_SHOWN]) + (
                f" and {len(cleared) - CLEARED_SHOWN:,} more" if len(cleared) > CLEARED_SHOWN else ""
            )
            what = " with its downstream" if downstream else ""
            return Done(f"{key}: cleared{what}, {len(cleared):,} task(s) to run again: {shown}", run_id,
                        {"cleared": cleared, "downstream": downstream})  # fmt: skip
        if action == "mark":
            to = _mark_state(self)
            held: TaskState = await self.blocking(orc.mark, run_id, key, to, by=by)
            return Done(f"{key}: marked {to.value} (was {held.value})", run_id, {"state": to.value, "was": held.value})
        if action in ("approve", "reject"):
            comment = self.get_argument("comment", "").strip() or None
            answer = orc.approve if action == "approve" else orc.reject
            await self.blocking(answer, run_id, key, by=by, comment=comment)
            return Done(f"{key}: {action}d", run_id, {"comment": comment})
        fn = {"retry": orc.retry_task, "skip": orc.skip_task, "fail": orc.fail_task}[action]
        await self.blocking(fn, run_id, key, by=by)
        return Done(f"{key}: {action} done", run_id)


class RunAction(_Act):
    async def post(self, run_id: str, key: str | None = None, action: str = "cancel") -> None:
        done = await self.act(run_id, key, action)
        # the outcome travels in a signed one-time cookie: a link cannot put words in the banner;
        # a rerun's banner links back to the run it repeats
        flash = {"text": done.text, "from": run_id if done.run_id != run_id else None}
        self.set_signed_cookie(
            "orc_done", json.dumps(flash), expires_days=None, httponly=True, samesite="Strict",
            secure=self.secure_cookies,
        )  # fmt: skip
        self.redirect(f"/runs/{quote(done.run_id)}", status=303)


class ApiRuns(_Base):
    api = True

    async def get(self) -> None:
        limit = _int_arg(self, "limit", PAGE_SIZE, 1, 1000)
        offset = _int_arg(self, "offset", 0, 0, MAX_OFFSET)
        views = await self.blocking(self.orc.runs, limit, offset=offset, **_filters(self))
        self.write({"runs": [v.to_json() for v in views], "limit": limit, "offset": offset})


class ApiRun(_Base):
    """``GET /api/runs/RUN_ID``: the run, paged (see :func:`run_document`); ``next`` holds the
    links to the following pages."""

    api = True

    async def get(self, run_id: str) -> None:
        tq = _task_query(self, API_LIMIT)
        events = _int_arg(self, "events", API_LIMIT, 0, MAX_EVENTS)
        events_before = _opt_int(self, "events_before")
        edges_after = _edge_cursor(self)
        doc = await self.blocking(
            run_document, self.orc, run_id, tasks=tq, events=events, events_before=events_before,
            edges_after=edges_after,
        )  # fmt: skip
        page = doc["page"]
        base = {**tq.params(API_LIMIT)}
        if events != API_LIMIT:
            base["events"] = str(events)
        here = f"/api/runs/{quote(run_id)}?"

        def link(**cursor: Any) -> str:
            return here + urlencode({**base, **cursor})

        doc["next"] = {
            "tasks": link(after=page["tasks_after"]) if page["tasks_after"] else None,
            "tasks_before": link(before=page["tasks_before"]) if page["tasks_before"] else None,
            "edges": link(edges_after=page["edges_after"]) if page["edges_after"] else None,
            "events": link(events_before=page["events_before"]) if page["events_before"] else None,
            "changes": f"/api/runs/{quote(run_id)}/changes?after={page['last_event']}",
        }
        self.write(doc)


class ApiChanges(_Base):
    """``GET /api/runs/RUN_ID/changes?after=EVENT_ID[&limit=N]``: what changed since a ledger
    id (see :func:`run_changes`); the run page polls it."""

    api = True

    async def get(self, run_id: str) -> None:
        after = _int_arg(self, "after", 0, 0, 2**62)
        limit = _int_arg(self, "limit", CHANGES_LIMIT, 1, CHANGES_LIMIT)
        self.write(await self.blocking(run_changes, self.orc, run_id, after, limit))


class RunScript(_Base):
    """``/static/run.js``: the run page's script (a file of this origin, as the CSP wants)."""

    page = False

    def get(self) -> None:
        self.set_header("Content-Type", "text/javascript; charset=utf-8")
        self.write(RUN_SCRIPT.read_bytes())


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
        self.write({"ok": True, "run": run_id, "key": key, "action": action, "done": done.text, **done.extra})


class ApiEvents(_Base):
    """``POST /api/events`` with a JSON body ``{"key", "payload", "event_id"}``: emit an event
    as the credential's tenant (a credential bound to a tenant emits for it only; one for every
    tenant may name ``"tenant"``, else ``default``). Answers ``{"ok": true, "id", "event_id",
    "duplicate", "woken"}``, or ``{"error"}`` with 400 (bad input), 403 (another tenant) or 409
    (an ``event_id`` reused with another key or payload: ``EventIdConflict``)."""

    api = True

    async def post(self) -> None:
        self.require_write()
        orc = self.orc
        body = self.request.body or b""
        if len(body) > 2 * orc.settings.max_event_bytes + 4096:
            raise tornado.web.HTTPError(413, reason="event body too large (ORCHESTRATOR_MAX_EVENT_BYTES)")
        try:
            # parse_spec: no NaN, no duplicate key, and nesting too deep is a refusal (never a
            # RecursionError); the payload is then held to MAX_JSON_DEPTH by emit
            doc = parse_spec(body.decode("utf-8") or "null", fmt="json")
        except (UnicodeDecodeError, SpecError) as exc:
            why = "not UTF-8" if isinstance(exc, UnicodeDecodeError) else str(exc)
            raise ValidationError(f"the body must be a JSON object {{key, payload, event_id}} ({why})") from None
        if not isinstance(doc, dict):
            raise ValidationError("the body must be a JSON object {key, payload, event_id}")
        unknown = set(doc) - {"key", "payload", "event_id", "tenant"}
        if unknown:
            raise ValidationError(f"unknown field(s) {sorted(unknown)}; an event has key, payload, event_id")
        tenant = doc.get("tenant")
        cred = self.current_user
        if tenant is not None and cred is not None and cred.tenant is not None and tenant != cred.tenant:
            raise tornado.web.HTTPError(403, reason=f"this credential emits for tenant {cred.tenant!r} only")
        done = await self.blocking(
            orc.emit, doc.get("key"), doc.get("payload"), event_id=doc.get("event_id"), tenant=tenant, by=self.by()
        )
        self.write(
            {"ok": True, "id": done.id, "event_id": done.event_id, "duplicate": done.duplicate, "woken": done.woken}
        )


class Metrics(_Base):
    page = False  # a scraper: 401, never the login form

    async def get(self) -> None:
        from .metrics import render as render_metrics

        body, content_type = await self.blocking(render_metrics, self.orc, accept=self.request.headers.get("Accept"))
        self.set_header("Content-Type", content_type)
        self.write(body)


RUN_ID = r"([A-Za-z0-9_-]{1,32})"
#: a task's key in a path: a map child's ``node[key]`` arrives as is or percent-encoded (Tornado
#: decodes the group); the store finds the task or answers 404
KEY_CHARS = r"[A-Za-z0-9_.,:=%\[\]-]{1,400}"
#: the actions' addresses (named groups: a run's own action has no task key); a task's
#: action is one of :data:`ACTIONS`
RUN_ACTION = r"/runs/(?P<run_id>[A-Za-z0-9_-]{1,32})/(?P<action>cancel|rerun)"
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


# ------------------------------------------------------------------ templates (orchestrator/templates)


TEMPLATES = Loader(str(Path(__file__).parent / "templates"), autoescape="xhtml_escape")


def render(name: str, **values: Any) -> bytes:
    handler = values["handler"]
    return TEMPLATES.load(name).generate(
        xsrf=handler.xsrf_form_html,
        quote=quote,
        user=handler.current_user.name if handler.current_user else None,
        can_write=handler.current_user is not None,
        nonce=handler.nonce,
        ceil=math.ceil,
        map_text=mapped_text,
        **values,
    )
