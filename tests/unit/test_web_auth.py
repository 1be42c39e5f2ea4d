"""``orchestrator serve``'s login and its edges: wrong credentials rate-limited on every path
(per client and in total, 429 with ``Retry-After``) while the right one still works for others;
a login link from another site sets no cookie; ``Secure`` cookies over TLS or behind a TLS
proxy; ``/logout``; short basic-auth passwords refused on a public bind."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlencode

import pytest
from tornado.testing import AsyncHTTPSTestCase

from orchestrator import Settings
from orchestrator.core.errors import ConfigurationError
from orchestrator.web.app import make_app
from orchestrator.web.auth import Access, LoginLimiter
from tests.unit.test_web import TOKEN, WebCase, basic, bearer, make_orc

PASSWORD = "correct-horse-battery"
AUTH = f"admin:{PASSWORD}, {TOKEN}"
OTHER = "127.0.0.2"  # another client: the loopback network answers from any 127.x address


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class LimitedCase(WebCase):
    auth = AUTH
    bind = "0.0.0.0"
    per_client = 1000
    total = 1000

    def get_app(self) -> Any:
        self.clock = Clock()
        self.limiter = LoginLimiter(
            per_client=self.per_client, total=self.total, window=60.0, delay=0.01, clock=self.clock
        )
        return make_app(self.orc, auth=self.auth, bind=self.bind, cookie_secret="test-secret", limiter=self.limiter)

    def from_other(self, path: str, **headers: str) -> Any:
        """A GET from another client address."""
        return self.fetch(
            path, headers={"Host": "127.0.0.1", **headers}, follow_redirects=False, network_interface=OTHER
        )

    def wrong(self, how: str) -> Any:
        """One wrong credential, by one of the four ways a credential comes in."""
        if how == "basic":
            return self.get("/api/runs", **basic("admin", "wrong-password-1"))
        if how == "bearer":
            return self.get("/api/runs", **bearer("wrong-token-0123456789"))
        if how == "url":
            return self.get("/login?token=wrong-token-0123456789", **{"Sec-Fetch-Site": "none"})
        token, headers = self.xsrf()
        return self.post("/login", {"_xsrf": token, "token": "wrong-token-0123456789"}, **headers)


class TestPerClient(LimitedCase):
    per_client = 4

    def test_a_client_with_too_many_wrong_credentials_is_refused_and_others_are_not(self) -> None:
        session = self.log_in(TOKEN)
        # Given four wrong credentials from one client, one by each way in
        codes = [self.wrong(how).code for how in ("basic", "bearer", "url", "form")]
        assert codes == [401, 401, 403, 401], codes
        # When it tries again, by any way, even with the right credential
        for attempt in (
            self.get("/api/runs", **basic("admin", "wrong-password-1")),
            self.get("/api/runs", **bearer(TOKEN)),
            self.get("/api/runs", **basic("admin", PASSWORD)),
            self.get("/login?" + urlencode({"token": TOKEN}), **{"Sec-Fetch-Site": "none"}),
        ):
            # Then it is answered 429 with Retry-After, before anything is checked
            assert attempt.code == 429, attempt.code
            assert 1 <= int(attempt.headers["Retry-After"]) <= 60
        # And another client's right credential works, its wrong one is an ordinary 401
        assert self.from_other("/api/runs", **bearer(TOKEN)).code == 200
        assert self.from_other("/api/runs", **basic("admin", PASSWORD)).code == 200
        assert self.from_other("/api/runs", **bearer("wrong-token-0123456789")).code == 401
        # And a session cookie the locked client already holds is no guess: it still works
        assert self.get("/runs", Cookie=session).code == 200
        # And once the window has passed, the client may try again
        self.clock.now += 60
        assert self.get("/api/runs", **bearer(TOKEN)).code == 200

    def test_an_ipv6_client_counts_by_its_network(self) -> None:
        same = LoginLimiter.client_of("2001:db8::1")
        assert same == LoginLimiter.client_of("2001:db8::ffff:2") == "2001:db8::/64"
        assert LoginLimiter.client_of("::ffff:10.0.0.7") == "10.0.0.7"
        assert LoginLimiter.client_of("10.0.0.7") != LoginLimiter.client_of("10.0.0.8")


class TestTotal(LimitedCase):
    total = 3

    def test_the_total_limit_slows_wrong_credentials_and_never_refuses_the_right_one(self) -> None:
        # Given wrong credentials from two clients, past the total budget
        assert [self.wrong("bearer").code for _ in range(2)] == [401, 401]
        assert self.from_other("/api/runs", **bearer("wrong-token-0123456789")).code == 401
        # Then a further wrong credential, from anyone, is answered 429 with Retry-After
        for refused in (self.wrong("basic"), self.from_other("/api/runs", **bearer("wrong-token-0123456789"))):
            assert refused.code == 429 and int(refused.headers["Retry-After"]) >= 1
        # And the right credential still works, by every way in, from either client
        assert self.get("/api/runs", **bearer(TOKEN)).code == 200
        assert self.get("/api/runs", **basic("admin", PASSWORD)).code == 200
        assert self.from_other("/api/runs", **bearer(TOKEN)).code == 200
        token, headers = self.xsrf()
        assert self.post("/login", {"_xsrf": token, "token": TOKEN}, **headers).code == 302


class TestLoginLink(LimitedCase):
    def test_a_login_link_from_another_site_sets_no_cookie(self) -> None:
        link = "/login?" + urlencode({"token": TOKEN, "next": "/runs"})
        # a link on another site, or a client that says nothing: the form, no cookie
        for headers in ({"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"}, {}):
            page = self.get(link, **headers)
            assert page.code == 200, (headers, page.code)
            assert "orc_user" not in page.headers.get("Set-Cookie", ""), headers
            assert 'action="/login"' in page.body.decode()
        # the form's POST from another site is refused; from this app's page it logs in
        token, headers = self.xsrf()
        forged = self.post("/login", {"_xsrf": token, "token": TOKEN}, **headers, **{"Sec-Fetch-Site": "cross-site"})
        assert forged.code == 403 and "orc_user" not in forged.headers.get("Set-Cookie", "")
        confirmed = self.post(
            "/login", {"_xsrf": token, "token": TOKEN}, **headers, **{"Sec-Fetch-Site": "same-origin"}
        )
        assert confirmed.code == 302 and "orc_user=" in confirmed.headers["Set-Cookie"]
        # typed, pasted or opened from a terminal (Sec-Fetch-Site: none): logged in at once
        typed = self.get(link, **{"Sec-Fetch-Site": "none"})
        assert typed.code == 302 and "orc_user=" in typed.headers["Set-Cookie"]

    def test_logout_clears_the_session(self) -> None:
        session = {"Cookie": self.log_in(TOKEN)}
        assert self.get("/runs", **session).code == 200
        token, headers = self.xsrf()
        both = {"Cookie": session["Cookie"] + "; " + headers["Cookie"]}
        assert 'action="/logout"' in self.get("/runs", **both).body.decode()
        assert self.post("/logout", **both).code == 403  # no XSRF token: no forged logout
        done = self.post("/logout", {"_xsrf": token}, **both)
        assert done.code == 303 and done.headers["Location"] == "/login"
        cleared = re.search(r"orc_user=([^;]*);[^,]*expires=([^;]+)", done.headers["Set-Cookie"], re.I)
        assert cleared is not None and cleared.group(1) in ("", '""'), done.headers["Set-Cookie"]
        assert self.get("/logout", **session).code == 405

    def test_cookies_are_not_secure_over_plain_http_whatever_the_headers_say(self) -> None:
        done = self.get(
            "/login?" + urlencode({"token": TOKEN}), **{"Sec-Fetch-Site": "none", "X-Forwarded-Proto": "https"}
        )
        assert done.code == 302 and "secure" not in done.headers["Set-Cookie"].lower()


class TestBehindTlsProxy(LimitedCase):
    def get_app(self) -> Any:
        settings = Settings.from_env({"ORCHESTRATOR_UI_BEHIND_TLS_PROXY": "true"}, database_url="postgresql://x/y")
        assert settings.ui_behind_tls_proxy is True
        return make_app(self.orc, auth=self.auth, bind=self.bind, cookie_secret="t", behind_tls_proxy=True)

    def test_every_cookie_is_secure(self) -> None:
        done = self.get("/login?" + urlencode({"token": TOKEN}), **{"Sec-Fetch-Site": "none"})
        assert done.code == 302 and "secure" in done.headers["Set-Cookie"].lower()
        page = self.get("/login")
        assert "secure" in page.headers["Set-Cookie"].lower()  # the XSRF cookie too


class TestOverTls(AsyncHTTPSTestCase):
    def setUp(self) -> None:
        import tempfile
        from pathlib import Path

        self.orc = make_orc(Path(tempfile.mkdtemp(prefix="orc-web-tls-")))
        super().setUp()

    def tearDown(self) -> None:
        super().tearDown()
        self.orc.store.dispose()

    def get_app(self) -> Any:
        return make_app(self.orc, auth=AUTH, bind="0.0.0.0", cookie_secret="t")

    def test_the_session_cookie_is_secure_over_tls(self) -> None:
        done = self.fetch(
            "/login?" + urlencode({"token": TOKEN}),
            headers={"Sec-Fetch-Site": "none"},
            follow_redirects=False,
            validate_cert=False,
        )
        assert done.code == 302 and "secure" in done.headers["Set-Cookie"].lower()


def test_a_short_basic_password_is_refused_on_a_public_bind() -> None:
    for public in ("0.0.0.0", "10.0.0.5", "::", ""):
        with pytest.raises(ConfigurationError, match="at least 12 characters") as caught:
            Access("root:long-enough-pass, admin:short-pw11", public)
        assert "entry 2 (user 'admin')" in str(caught.value) and "short-pw11" not in str(caught.value)
    assert Access("admin:short-pw11", "127.0.0.1").has_basic  # loopback: only this machine can try
    assert Access("admin:twelve-chars", "0.0.0.0").has_basic
