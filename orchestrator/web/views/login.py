"""``/login`` and ``/logout``: the session cookie of a token login.

``/login?token=`` logs in directly only from a typed or same-origin navigation
(``Sec-Fetch-Site``), else it shows the form; ``POST /logout`` clears the session; cookies are
``Secure`` over TLS or behind a TLS proxy (``ORCHESTRATOR_UI_BEHIND_TLS_PROXY``, ``serve
--behind-tls-proxy``). Every way in is rate-limited (:class:`~orchestrator.web.auth.LoginLimiter`)."""

from __future__ import annotations

import tornado.web

from ..auth import SESSION_COOKIE, Credential, safe_next
from ..base import BaseHandler, render


class Login(BaseHandler):
    """``GET /login?token=TOKEN`` (the URL ``serve`` prints) and the form: a right token sets the
    session cookie and goes on to ``next`` (default ``/runs``); a wrong one sets nothing. Both are
    rate-limited (:class:`~orchestrator.web.auth.LoginLimiter`).

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


class Logout(BaseHandler):
    """``POST /logout`` (XSRF token, same origin): clears the session cookie and goes to the
    login form. A browser keeps basic-auth passwords itself: only closing it forgets them."""

    def post(self) -> None:
        self.clear_cookie(SESSION_COOKIE, httponly=True, samesite="Lax", secure=self.secure_cookies)
        self.redirect("/login", status=303)
