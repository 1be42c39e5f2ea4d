"""The base handler of every page and API address (:class:`BaseHandler`), and the templates.

Every response carries a Content-Security-Policy (scripts of this origin, or inline ones with
the page's nonce only), ``X-Frame-Options: DENY``, ``nosniff``, ``Referrer-Policy:
same-origin`` and ``Cache-Control: no-store``. A browser POST always needs the XSRF token of the
page it came from; a bearer-token request needs none (a browser never sends that header by
itself). A browser's POST from another origin (another port of this host included) is refused
by its ``Origin`` / ``Sec-Fetch-Site``. A URL longer than :data:`MAX_URL_BYTES` is answered 414,
headers larger than :data:`MAX_HEADER_BYTES` 431. Errors answer as HTML or JSON (``api``), an
:class:`~orchestrator.core.errors.OrchestratorError` mapped to its status (404, 409, 400).
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode, urlsplit

import tornado.web
from tornado.log import access_log
from tornado.template import Loader

from ..core.errors import (
    ConflictError,
    OperatorError,
    OrchestratorError,
    RunNotFound,
    TaskNotFound,
    ValidationError,
)
from ..core.explain import mapped_text
from .auth import SESSION_COOKIE, Access, Credential, LoginLimiter, TooManyAttempts

if TYPE_CHECKING:
    from ..engine.facade import Orchestrator

#: the longest URL (request target) answered: longer is 414
MAX_URL_BYTES = 8 * 1024

#: the most bytes of request headers answered: more is 431
MAX_HEADER_BYTES = 32 * 1024


def log_request(handler: tornado.web.RequestHandler) -> None:
    """The access log line, without the query string (a login URL carries its token) and with
    the path cut to 200 characters (a 414's URL is up to a megabyte)."""
    status = handler.get_status()
    log_method = access_log.info if status < 400 else access_log.warning if status < 500 else access_log.error
    request = handler.request
    path = request.path if len(request.path) <= 200 else request.path[:200] + "…"
    log_method("%d %s %s (%s) %.2fms", status, request.method, path, request.remote_ip, 1000 * request.request_time())


def content_security_policy(nonce: str) -> str:
    return (
        f"default-src 'none'; script-src 'self' 'nonce-{nonce}'; style-src 'self' 'unsafe-inline';"
        " img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none';"
        " base-uri 'none'"
    )


class BaseHandler(tornado.web.RequestHandler):
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


def progress_text(progress: dict[str, Any]) -> str:
    """A task's last progress report as its row shows it: ``STATE {meta}`` (bounded)."""
    meta = progress.get("meta")
    told = "" if meta is None else " " + json.dumps(meta, separators=(",", ":"))
    return f"{progress.get('state')}{told}"[:120]


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
        progress_text=progress_text,
        **values,
    )
