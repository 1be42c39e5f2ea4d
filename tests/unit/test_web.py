"""``orchestrator serve`` over HTTP (Tornado's test client, a real socket) on the Postgres test
database, and the DAG drawing: pages, JSON, actions with XSRF; authentication on every read and
write (the token made at start on loopback, the refusal of a public bind without credentials,
proxy headers that change nothing, tenant-bound credentials); security headers; 414/431."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from tornado.testing import AsyncHTTPTestCase

from orchestrator import DAG, Orchestrator, Settings, TaskState
from orchestrator.core import graph as drawing
from orchestrator.core.errors import ConfigurationError
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from orchestrator.core.routing import default_queues
from orchestrator.web.app import SERVER_OPTIONS, make_app
from orchestrator.web.auth import Access, is_loopback, parse_ui_auth
from tests.conftest import clean_test_database
from tests.integration.conftest import stop_process

TOKEN = "s3cret-token-0123456789"


def make_orc(tmp: Path) -> Orchestrator:
    """An orchestrator on the emptied test database, with a live worker of 10 slots."""
    settings = Settings.from_env({}, data_dir=str(tmp), database_url=clean_test_database())
    orc = Orchestrator(settings, publisher=RecordingPublisher(), registry=StaticRegistry(["t.ok", "t.fail"]))
    orc.register_worker("w", default_queues(), 10)
    return orc


def finish(orc: Orchestrator, *, fail: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    """Run every dispatched task to the end: the keys in ``fail`` fail (max_attempts 1: FAILED)."""
    publisher = orc.publisher
    assert isinstance(publisher, RecordingPublisher)
    while batch := publisher.take():
        for d in batch:
            assert orc.claim(d.token, "w:1", d.task_name) is not None
            if d.key in fail:
                orc.fail_attempt(d.token, error="boom", exc_types=["ValueError"], fingerprint="boom")
            else:
                orc.complete(d.token, {"key": d.key})


def diamond(name: str = "diamond") -> DAG:
    dag = DAG(name)
    a = dag.task("a", "t.ok")
    b = dag.task("b", "t.fail", upstream=[a])
    c = dag.task("c", "t.ok", upstream=[a])
    dag.task("d", "t.ok", upstream=[c], trigger_rule="all_done")
    assert b.key == "b"  # a leaf: its retry is allowed while the run is FAILED
    return dag


PROXY_HEADERS = {
    "X-Forwarded-For": "203.0.113.9",
    "X-Forwarded-Host": "orc.example",
    "X-Forwarded-Proto": "https",
    "X-Real-IP": "203.0.113.9",
    "Forwarded": "for=203.0.113.9;proto=https",
    "X-Client-IP": "203.0.113.9",
    "X-Cluster-Client-IP": "203.0.113.9",
    "X-Original-Forwarded-For": "203.0.113.9",
    "True-Client-IP": "203.0.113.9",
    "CF-Connecting-IP": "203.0.113.9",
    "Fastly-Client-IP": "203.0.113.9",
    "X-Forwarded": "for=203.0.113.9",
    "Forwarded-For": "203.0.113.9",
    "Via": "1.1 proxy.example",
}


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class WebCase(AsyncHTTPTestCase):
    auth = ""
    bind = "127.0.0.1"

    def setUp(self) -> None:
        import tempfile

        self.tmp = Path(tempfile.mkdtemp(prefix="orc-web-"))
        self.orc = make_orc(self.tmp)
        super().setUp()
        #: the headers every request sends unless told otherwise (a logged-in browser, here)
        self.session: dict[str, str] = {}

    def tearDown(self) -> None:
        super().tearDown()
        self.orc.store.dispose()

    def get_app(self) -> Any:
        return make_app(self.orc, auth=self.auth, bind=self.bind, cookie_secret="test-secret")

    def get_httpserver_options(self) -> dict[str, Any]:
        return dict(SERVER_OPTIONS)

    @property
    def generated(self) -> str:
        return str(self._app.settings["access"].generated)

    def _headers(self, headers: dict[str, str], anonymous: bool) -> dict[str, str]:
        merged = {"Host": "127.0.0.1", **({} if anonymous else self.session)}
        for k, v in headers.items():
            if k == "Cookie" and "Cookie" in merged:
                v = merged["Cookie"] + "; " + v
            merged[k] = v
        return merged

    def get(self, path: str, *, anonymous: bool = False, **headers: str) -> Any:
        return self.fetch(path, headers=self._headers(headers, anonymous), follow_redirects=False)

    def post(self, path: str, form: dict[str, str] | None = None, *, anonymous: bool = False, **headers: str) -> Any:
        body = urlencode(form or {})
        return self.fetch(
            path, method="POST", body=body, headers=self._headers(headers, anonymous), follow_redirects=False
        )

    def xsrf(self, **headers: str) -> tuple[str, dict[str, str]]:
        """A page's XSRF token and the cookie that goes with it."""
        page = self.get("/login", anonymous=True, **headers)
        assert page.code == 200, page.code
        cookie = re.search(r"_xsrf=([^;]+)", page.headers["Set-Cookie"])
        assert cookie is not None
        return cookie.group(1), {"Cookie": f"_xsrf={cookie.group(1)}", **headers}

    def log_in(self, token: str) -> str:
        """``GET /login?token=``: the session cookie (as a Cookie header value)."""
        done = self.get("/login?" + urlencode({"token": token}), anonymous=True, **{"Sec-Fetch-Site": "none"})
        assert done.code == 302 and done.headers["Location"] == "/runs", done.code
        session = re.search(r"orc_user=([^;]+)", done.headers["Set-Cookie"])
        assert session is not None
        return f"orc_user={session.group(1)}"

    def failed_run(self, tenant: str | None = None) -> str:
        run = self.orc.submit(diamond(), tenant=tenant)
        finish(self.orc, fail={"b"})
        return run.id


class TestLocal(WebCase):
    """Loopback, no ORCHESTRATOR_UI_AUTH: a token made at start, needed by every request."""

    def setUp(self) -> None:
        super().setUp()
        self.session = {"Cookie": self.log_in(self.generated)}

    def test_runs_list_filters_and_pages(self) -> None:
        ids = [self.orc.submit(diamond(f"dag{i % 2}")).id for i in range(5)]
        page = self.get("/runs")
        assert page.code == 200 and all(i.encode() in page.body for i in ids)
        only = self.get("/runs?dag=dag1")
        assert sum(i.encode() in only.body for i in ids) == 2
        api = json.loads(self.get("/api/runs?dag=dag0&limit=2&offset=1").body)
        assert [r["id"] for r in api["runs"]] == [ids[2], ids[0]]
        assert json.loads(self.get("/api/runs?state=SUCCEEDED").body)["runs"] == []
        bad = self.get("/api/runs?state=DONE")
        assert bad.code == 400 and "unknown run state" in json.loads(bad.body)["error"]
        assert self.get("/runs?page=0").code == 400

    def test_a_registered_runs_version_on_its_page_and_in_the_list(self) -> None:
        self.orc.register(diamond("reg"))
        run = self.orc.submit_registered("reg")
        html = self.get(f"/runs/{run.id}").body.decode()
        assert '<span id="dag-version">v1</span>' in html
        assert "reg v1" in self.get("/runs").body.decode()
        assert json.loads(self.get(f"/api/runs/{run.id}").body)["run"]["dag_version"] == 1
        again = self.orc.rerun(run.id)
        assert f'id="rerun-source" href="/runs/{run.id}"' in self.get(f"/runs/{again.id}").body.decode()

    def test_run_page_and_json(self) -> None:
        run_id = self.failed_run()
        page = self.get(f"/runs/{run_id}")
        assert page.code == 200
        html = page.body.decode()
        for key, state in {"a": "SUCCEEDED", "b": "FAILED", "c": "SUCCEEDED", "d": "SUCCEEDED"}.items():
            assert f'data-key="{key}" data-state="{state}"' in html
        assert 'data-rule="all_done"' in html and 'class="edge rule"' in html
        assert "/runs/" + run_id + "/tasks/b/retry" in html  # a FAILED task of a FAILED run can be retried
        doc = json.loads(self.get(f"/api/runs/{run_id}").body)
        assert doc["run"]["state"] == "FAILED"
        assert sorted(map(tuple, doc["edges"])) == [("a", "b"), ("a", "c"), ("c", "d")]
        assert {t["key"]: t["state"] for t in doc["tasks"]}["b"] == "FAILED"
        assert doc["events"][0]["to"] == "RUNNING" and doc["waiting"] == {}
        newest = json.loads(self.get(f"/api/runs/{run_id}?events=2").body)["events"]
        assert newest == doc["events"][-2:]
        assert self.get(f"/api/runs/{run_id}?events=-1").code == 400
        dot = self.get(f"/api/runs/{run_id}/graph?format=dot")
        assert dot.code == 200 and b"rankdir=LR" in dot.body and b"style=dashed" in dot.body
        mermaid = self.get(f"/api/runs/{run_id}/graph?format=mermaid").body.decode()
        assert mermaid.startswith("flowchart LR") and mermaid.count("-.->") == 1
        assert self.get(f"/api/runs/{run_id}/graph?format=png").code == 400

    def test_waiting_tasks_say_why(self) -> None:
        run = self.orc.submit(diamond())
        doc = json.loads(self.get(f"/api/runs/{run.id}").body)
        assert set(doc["waiting"]) == {"a", "b", "c", "d"}
        assert "waiting_on_parents" in [r["kind"] for r in doc["waiting"]["d"]]

    def test_unknown_run_is_404(self) -> None:
        assert self.get("/runs/nope").code == 404
        api = self.get("/api/runs/nope")
        assert api.code == 404 and json.loads(api.body)["error"] == "no run with id 'nope'"
        assert self.get("/no/such/page").code == 404

    def test_actions_need_the_xsrf_token_and_are_audited(self) -> None:
        run_id = self.failed_run()
        assert self.post(f"/runs/{run_id}/tasks/b/retry").code == 403  # no XSRF token
        token, headers = self.xsrf()
        done = self.post(f"/runs/{run_id}/tasks/b/retry", {"_xsrf": token}, **headers)
        assert done.code == 303 and done.headers["Location"] == f"/runs/{run_id}"
        flash = re.search(r"orc_done=([^;]+)", done.headers["Set-Cookie"])
        assert flash is not None
        page = self.get(f"/runs/{run_id}", Cookie=f"orc_done={flash.group(1)}")
        assert b'class="banner ok">b: retry done' in page.body
        # the banner says only what the app signed: a link cannot put words in it
        forged = self.get(f"/runs/{run_id}?done=session+expired", Cookie="orc_done=session-expired")
        assert b"banner ok" not in forged.body
        assert self.orc.run(run_id).task("b").state in (TaskState.READY, TaskState.QUEUED)
        by = [e.by for e in self.orc.run(run_id).events() if e.actor == "operator"]
        assert len(by) >= 1 and set(by) == {"token (web from 127.0.0.1)"}
        # a refused action: 409 with the reason, and the refusal is in the ledger
        again = self.post(f"/api/runs/{run_id}/tasks/b/retry", {"_xsrf": token}, **headers)
        assert again.code == 409 and "only DEAD_LETTER or FAILED" in json.loads(again.body)["error"]
        cancelled = json.loads(self.post(f"/api/runs/{run_id}/cancel", {"_xsrf": token}, **headers).body)
        assert cancelled["ok"] is True and self.orc.run(run_id).state.value == "CANCELLED"

    def test_a_post_from_another_origin_is_refused(self) -> None:
        """Cookies are scoped by host, not port: a page on another port of this host could plant
        an _xsrf cookie it knows. The browser's Origin / Sec-Fetch-Site give it away."""
        run_id = self.failed_run()
        token, headers = self.xsrf()
        for extra in (
            {"Origin": "http://127.0.0.1:8000"},
            {"Origin": "http://evil.example"},
            {"Sec-Fetch-Site": "same-site"},
            {"Sec-Fetch-Site": "cross-site"},
        ):
            refused = self.post(f"/runs/{run_id}/cancel", {"_xsrf": token}, **extra, **headers)
            assert refused.code == 403, extra
        assert self.orc.run(run_id).state.value != "CANCELLED"
        own = {"Origin": "http://127.0.0.1", "Sec-Fetch-Site": "same-origin"}
        assert self.post(f"/runs/{run_id}/tasks/b/retry", {"_xsrf": token}, **own, **headers).code == 303

    def test_a_large_body_is_refused_before_it_is_read(self) -> None:
        token, headers = self.xsrf()
        big = self.post("/login", {"_xsrf": token, "token": "x" * 100_000}, anonymous=True, **headers)
        assert big.code == 400, big.code  # Tornado refuses a Content-Length over max_body_size

    def test_metrics_are_read_from_the_database(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        self.orc.submit(diamond())  # a is QUEUED (one worker), b, c, d PENDING
        scrape = self.get("/metrics")
        assert scrape.code == 200 and scrape.headers["Content-Type"].startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(scrape.body.decode())}
        assert families["orchestrator_database_up"].samples[0].value == 1
        by_state: dict[str, float] = {}
        for sample in families["orchestrator_tasks"].samples:
            by_state[sample.labels["state"]] = by_state.get(sample.labels["state"], 0) + sample.value
        assert {k: v for k, v in by_state.items() if v} == {"QUEUED": 1, "PENDING": 3}
        open_metrics = self.get("/metrics", Accept="application/openmetrics-text; version=1.0.0")
        assert open_metrics.headers["Content-Type"].startswith("application/openmetrics-text")

    def test_every_read_and_write_needs_the_token(self) -> None:
        run_id = self.failed_run()
        assert len(self.generated) >= 32
        for path in ("/", "/runs", f"/runs/{run_id}"):
            page = self.get(path, anonymous=True)
            assert page.code == 302 and page.headers["Location"].startswith("/login?next="), path
        for path in ("/api/runs", f"/api/runs/{run_id}", f"/api/runs/{run_id}/graph?format=svg", "/metrics"):
            refused = self.get(path, anonymous=True)
            assert refused.code == 401 and run_id.encode() not in refused.body, path
        token, headers = self.xsrf()
        for path in (f"/runs/{run_id}/cancel", f"/api/runs/{run_id}/cancel", f"/api/runs/{run_id}/tasks/b/retry"):
            assert self.post(path, {"_xsrf": token}, anonymous=True, **headers).code == 401, path
        assert self.post(f"/api/runs/{run_id}/cancel", anonymous=True, **bearer("x" * 43)).code == 401
        assert self.orc.run(run_id).state.value == "FAILED"
        health = self.get("/healthz", anonymous=True)
        assert health.code == 200 and health.body == b"ok\n"
        # a wrong token: 403, and nothing set
        typed = {"Sec-Fetch-Site": "none"}  # the login URL typed, pasted or opened from a terminal
        wrong = self.get("/login?token=" + "x" * 43, anonymous=True, **typed)
        assert wrong.code == 403 and "Set-Cookie" not in wrong.headers
        assert self.get("/login?token=", anonymous=True, **typed).code == 403
        # the right one: the session, and on to /runs (or a path of this app given as next)
        cookie = self.log_in(self.generated)
        assert self.get("/runs", anonymous=True, Cookie=cookie).code == 200
        onward = self.get(
            "/login?" + urlencode({"token": self.generated, "next": f"/runs/{run_id}"}), anonymous=True, **typed
        )
        assert onward.code == 302 and onward.headers["Location"] == f"/runs/{run_id}"
        away = self.get(
            "/login?" + urlencode({"token": self.generated, "next": "//evil.example/"}), anonymous=True, **typed
        )
        assert away.headers["Location"] == "/runs"
        # scripts: the token as a bearer; a forged session cookie is nobody
        assert self.get(f"/api/runs/{run_id}", anonymous=True, **bearer(self.generated)).code == 200
        assert self.get("/api/runs", anonymous=True, Cookie="orc_user=token").code == 401
        # no Host check any more: the credential decides (a rebinding page has none)
        assert self.get("/runs", Host="evil.example:8080").code == 200
        assert self.get("/runs", anonymous=True, Host="evil.example:8080").code == 302

    def test_proxy_headers_change_nothing(self) -> None:
        """Each of 14 headers a proxy adds: without the token a write is refused and nothing is
        written; with it the header changes nothing."""
        token, headers = self.xsrf()
        for name, value in PROXY_HEADERS.items():
            run = self.orc.submit(diamond())
            before = len(self.orc.run(run.id).events())
            for path in (f"/api/runs/{run.id}/cancel", f"/runs/{run.id}/cancel", f"/api/runs/{run.id}/tasks/a/fail"):
                refused = self.post(path, {"_xsrf": token}, anonymous=True, **{name: value, **headers})
                assert refused.code in (401, 403), (name, path, refused.code)
            read = self.get(f"/api/runs/{run.id}", anonymous=True, **{name: value})
            assert read.code == 401 and run.id.encode() not in read.body, name
            assert self.orc.run(run.id).state.value == "RUNNING" and len(self.orc.run(run.id).events()) == before
            plain = json.loads(self.get(f"/api/runs/{run.id}", anonymous=True, **bearer(self.generated)).body)
            relayed = self.get(f"/api/runs/{run.id}", anonymous=True, **{name: value}, **bearer(self.generated))
            same = {k: v for k, v in json.loads(relayed.body).items() if k != "waiting"}  # "published 0.1s ago"
            assert relayed.code == 200 and same == {k: v for k, v in plain.items() if k != "waiting"}, name
            done = self.post(f"/api/runs/{run.id}/cancel", anonymous=True, **{name: value}, **bearer(self.generated))
            assert done.code == 200 and self.orc.run(run.id).state.value == "CANCELLED", name
            by = [e.by for e in self.orc.run(run.id).events() if e.actor == "operator"]
            assert by and set(by) == {"token (web from 127.0.0.1)"}, (name, by)  # the socket's address

    def test_security_headers_on_every_response(self) -> None:
        run_id = self.failed_run()
        responses = {
            "page": self.get(f"/runs/{run_id}"),
            "list": self.get("/runs"),
            "api": self.get(f"/api/runs/{run_id}"),
            "graph": self.get(f"/api/runs/{run_id}/graph?format=svg"),
            "metrics": self.get("/metrics"),
            "404": self.get("/api/runs/nope"),
            "no route": self.get("/nowhere"),
            "401": self.get("/api/runs", anonymous=True),
            "302": self.get("/runs", anonymous=True),
            "login": self.get("/login", anonymous=True),
            "403": self.get("/login?token=wrong", anonymous=True),
            "healthz": self.get("/healthz", anonymous=True),
            "414": self.get("/runs?q=" + "a" * 20_000, anonymous=True),
        }
        for what, r in responses.items():
            csp = r.headers.get("Content-Security-Policy", "")
            assert "script-src 'self' 'nonce-" in csp and "unsafe-inline" not in csp.split("style-src")[0], what
            assert "frame-ancestors 'none'" in csp, what
            assert r.headers.get("X-Frame-Options") == "DENY", what
            assert r.headers.get("X-Content-Type-Options") == "nosniff", what
            assert r.headers.get("Referrer-Policy") == "same-origin", what
        # the run page's scripts carry the response's nonce; no inline handler is left
        page = responses["page"]
        nonce = re.search(r"'nonce-([^']+)'", page.headers["Content-Security-Policy"])
        assert nonce is not None
        html = page.body.decode()
        scripts = re.findall(r"<script([^>]*)>", html)
        assert scripts and all(f'nonce="{nonce.group(1)}"' in s or "src=" in s for s in scripts), scripts
        assert not re.search(r"\son[a-z]+\s*=", html)
        assert nonce.group(1) not in self.get(f"/runs/{run_id}").headers["Content-Security-Policy"]  # per response

    def test_oversized_requests_are_answered(self) -> None:
        from orchestrator.web.base import MAX_HEADER_BYTES, MAX_URL_BYTES

        long_url = self.get("/api/runs?q=" + "a" * 100_000)  # the 100 KB query string
        assert long_url.code == 414 and "URL longer" in json.loads(long_url.body)["error"]
        assert self.get("/runs?q=" + "a" * (MAX_URL_BYTES + 1), anonymous=True).code == 414
        assert self.get("/api/runs?q=" + "a" * (MAX_URL_BYTES - 100)).code == 200
        big = self.get("/api/runs", **{"X-Big": "a" * (MAX_HEADER_BYTES + 1)})
        assert big.code == 431 and "headers larger" in json.loads(big.body)["error"]
        many = self.get("/runs", anonymous=True, **{f"X-H{i}": "b" * 1000 for i in range(40)})
        assert many.code == 431
        assert self.get("/api/runs", **{"X-Big": "a" * 20_000}).code == 200


def pipeline() -> DAG:
    """extract -> transform -> load -> report (all_done): tests/store/test_clear.py's shape."""
    dag = DAG("pipeline")
    dag.task("extract", "t.ok")
    dag.task("transform", "t.ok", upstream=["extract"])
    dag.task("load", "t.ok", upstream=["transform"])
    dag.task("report", "t.ok", upstream=["load"], trigger_rule="all_done")
    return dag


def breaking(*keys: str) -> Any:
    """A :func:`tests.store.dynamic.drive` body failing ``keys`` until ``body.broken`` is cleared."""
    from tests.store.dynamic import Fail

    broken = set(keys)

    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        if key in broken:
            raise Fail(f"{key} is broken")
        return key

    body.broken = broken  # type: ignore[attr-defined]
    return body


class TestClearMarkRerun(WebCase):
    """The run page's Clear (with or without its downstream), Mark (success / failed / skipped)
    and Rerun, and the same through the JSON API: as the other actions (XSRF, Origin, the
    credential's tenant, ``by``), and a refusal is a named error that writes nothing."""

    def setUp(self) -> None:
        super().setUp()
        self.session = {"Cookie": self.log_in(self.generated)}

    def broken_run(self) -> tuple[str, Any]:
        from tests.store.dynamic import drive

        body = breaking("transform")
        d = drive(self.orc, pipeline(), body)
        assert d.states() == {"extract": "SUCCEEDED", "transform": "FAILED", "load": "UPSTREAM_FAILED",
                              "report": "SUCCEEDED"}  # fmt: skip
        return d.run_id, body

    def written(self, run_id: str) -> tuple[int, dict[str, tuple[str, int]], int]:
        """What an action would write: the run's ledger length, its tasks (state, attempt), and
        how many runs there are."""
        tasks = {t.key: (t.state.value, t.attempt) for t in self.orc.tasks(run_id)}
        return len(self.orc.ledger(run_id)), tasks, len(self.orc.runs(1000))

    def banner(self, response: Any) -> str:
        """The page a form's POST goes on to, and its banner."""
        assert response.code == 303, (response.code, response.body[:300])
        flash = re.search(r"orc_done=([^;]+)", response.headers["Set-Cookie"])
        assert flash is not None
        page = self.get(response.headers["Location"], Cookie=f"orc_done={flash.group(1)}")
        found = re.search(r'<div class="banner ok">(.*?)</div>', page.body.decode())
        assert found is not None
        return found.group(1)

    def test_clear_with_downstream_runs_a_failed_task_and_its_downstream_again(self) -> None:
        from orchestrator.services.invariants import check_runs
        from tests.store.dynamic import drive

        run_id, body = self.broken_run()
        html = self.get(f"/runs/{run_id}").body.decode()
        form = f'action="/runs/{run_id}/tasks/transform/clear"'
        assert form in html and 'name="downstream" value="1" checked' in html
        assert f'action="/runs/{run_id}/tasks/transform/mark"' in html
        assert f'action="/runs/{run_id}/rerun"' in html
        # the FAILED task offers every mark but FAILED
        row = html.split('<tr id="task-transform"')[1].split("</tr>")[0]
        assert re.findall(r'<option value="([a-z]+)"', row) == ["success", "skipped"]
        token, headers = self.xsrf()
        assert self.post(f"/runs/{run_id}/tasks/transform/clear", {"downstream": "1"}).code == 403  # no XSRF
        body.broken.clear()  # the bug is fixed
        done = self.post(f"/runs/{run_id}/tasks/transform/clear", {"_xsrf": token, "downstream": "1"}, **headers)
        assert done.headers["Location"] == f"/runs/{run_id}"
        banner = self.banner(done)
        assert banner == "transform: cleared with its downstream, 3 task(s) to run again: load, report, transform"
        assert self.orc.run_state(run_id).value == "RUNNING"
        clears = [e for e in self.orc.ledger(run_id) if e.actor == "operator"]
        assert {e.key for e in clears} == {"transform", "load", "report", None}  # None: the run reopened
        assert {e.by for e in clears} == {"token (web from 127.0.0.1)"}
        d = drive(self.orc, pipeline(), body, run_id=run_id)
        assert set(d.states().values()) == {"SUCCEEDED"} and d.run_state() == "SUCCEEDED"
        assert self.orc.task(run_id, "report").attempt == 2 and self.orc.task(run_id, "extract").attempt == 1
        assert check_runs(self.orc.store, [run_id]) == []
        # the JSON API: without downstream, the task alone; the keys in the answer
        api = self.post(f"/api/runs/{run_id}/tasks/load/clear", {"_xsrf": token}, **headers)
        assert api.code == 200, api.body
        answer = json.loads(api.body)
        assert answer["ok"] is True and answer["cleared"] == ["load"] and answer["downstream"] is False
        assert self.orc.task(run_id, "report").attempt == 2  # not cleared

    def test_mark_success_lets_the_children_run(self) -> None:
        from tests.store.dynamic import drive

        run_id, body = self.broken_run()
        token, headers = self.xsrf()
        done = self.post(f"/runs/{run_id}/tasks/transform/mark", {"_xsrf": token, "state": "success"}, **headers)
        assert self.banner(done) == "transform: marked SUCCEEDED (was FAILED)"
        assert self.orc.task(run_id, "load").state.value in ("READY", "QUEUED")
        marked = [e for e in self.orc.ledger(run_id) if e.actor == "operator"]
        assert marked and {e.by for e in marked} == {"token (web from 127.0.0.1)"}
        d = drive(self.orc, pipeline(), body, run_id=run_id)  # transform is not run again
        assert set(d.states().values()) == {"SUCCEEDED"} and d.run_state() == "SUCCEEDED"
        assert [k for k, _, _ in d.ran] == ["load"]  # report (all_done) had run: it stands
        # through the API (a bearer token: no XSRF), by a state's own name too
        api = self.post(f"/api/runs/{run_id}/tasks/report/mark?state=SKIPPED", anonymous=True, **bearer(self.generated))
        assert api.code == 200, api.body
        assert json.loads(api.body) | {"done": ""} == {
            "ok": True, "run": run_id, "key": "report", "action": "mark", "done": "", "state": "SKIPPED",
            "was": "SUCCEEDED",
        }  # fmt: skip
        assert self.orc.task(run_id, "report").skip_reason == "user"

    def test_rerun_creates_a_linked_run_and_goes_to_it(self) -> None:
        run_id, _ = self.broken_run()
        token, headers = self.xsrf()
        done = self.post(f"/runs/{run_id}/rerun", {"_xsrf": token}, **headers)
        assert done.code == 303
        new = done.headers["Location"].removeprefix("/runs/")
        assert new != run_id and self.orc.run(new).status().dag == "pipeline"
        with self.orc.store.engine.connect() as conn:
            linked = conn.exec_driver_sql("SELECT rerun_of FROM orc_runs WHERE id = %s", (new,)).scalar_one()
        assert linked == run_id
        banner = self.banner(done)
        assert banner.startswith(f"new run {new}: a rerun of {run_id}")
        assert f'<a id="rerun-of" href="/runs/{run_id}">run {run_id}</a>' in banner  # a link back
        assert self.orc.run_state(run_id).value == "FAILED"  # the first run is left as it was
        api = json.loads(self.post(f"/api/runs/{run_id}/rerun", {"_xsrf": token}, **headers).body)
        assert api["ok"] is True and api["action"] == "rerun" and api["url"] == f"/runs/{api['rerun']}"
        assert api["rerun"] not in (run_id, new)

    def test_refusals_are_named_errors_that_write_nothing(self) -> None:
        from tests.store.dynamic import drive

        token, headers = self.xsrf()
        # a CANCELLED run: no Clear or Mark offered, and a POST anyway is refused by name
        cancelled = self.orc.submit(pipeline()).id
        self.orc.cancel(cancelled)
        html = self.get(f"/runs/{cancelled}").body.decode()
        assert '/clear"' not in html and '/mark"' not in html and f'action="/runs/{cancelled}/rerun"' in html
        before = self.written(cancelled)
        for path, form, message in (
            (
                "tasks/extract/clear",
                {"downstream": "1"},
                "is CANCELLED: its tasks cannot be cleared (rerun it instead)",
            ),
            ("tasks/extract/mark", {"state": "success"}, "is CANCELLED: its tasks cannot be marked"),
        ):
            page = self.post(f"/runs/{cancelled}/{path}", {"_xsrf": token, **form}, **headers)
            assert page.code == 400 and message in page.body.decode(), (path, page.code)
            assert 'class="banner error"' in page.body.decode() and f'href="/runs/{cancelled}"' in page.body.decode()
            api = self.post(f"/api/runs/{cancelled}/{path}", {"_xsrf": token, **form}, **headers)
            assert api.code == 400 and message in json.loads(api.body)["error"], path
        assert self.written(cancelled) == before
        # a map: its children are marked, not the map itself (its row offers no Mark)
        dag = DAG("mapped")
        dag.task("ls", "t.ok")
        dag.map("m", "t.ok", over="ls", kwarg="x")
        dag.task("join", "t.ok", upstream=["m"])
        mapped = drive(self.orc, dag, lambda k, kw, up: [1, 2, 3] if k == "ls" else k).run_id
        row = self.get(f"/runs/{mapped}?q=m").body.decode().split('<tr id="task-m"')[1].split("</tr>")[0]
        assert '/tasks/m/clear"' in row and '/mark"' not in row
        before = self.written(mapped)
        page = self.post(f"/runs/{mapped}/tasks/m/mark", {"_xsrf": token, "state": "failed"}, **headers)
        assert page.code == 400 and "task &#x27;m&#x27; is a map: mark its children" in page.body.decode()
        assert self.written(mapped) == before
        # bad input: a state a mark cannot set, no state, an unknown task, a bad flag
        run_id, _ = self.broken_run()
        before = self.written(run_id)
        for path, form, code, message in (
            ("tasks/transform/mark", {"state": "RUNNING"}, 400, "a mark's state must be success, failed or skipped"),
            ("tasks/transform/mark", {}, 400, "(it is missing)"),
            ("tasks/transform/mark", {"state": "failed"}, 400, "task 'transform' is already FAILED"),
            ("tasks/nope/clear", {}, 404, "has no task 'nope'"),
            ("tasks/transform/clear", {"downstream": "maybe"}, 400, "downstream must be 1 or 0"),
        ):
            api = self.post(f"/api/runs/{run_id}/{path}", {"_xsrf": token, **form}, **headers)
            assert api.code == code and message in json.loads(api.body)["error"], (path, form, api.body)
        assert self.post("/api/runs/nope/rerun", {"_xsrf": token}, **headers).code == 404
        assert self.written(run_id) == before

    def test_a_post_from_another_origin_is_refused(self) -> None:
        run_id, _ = self.broken_run()
        token, headers = self.xsrf()
        before = self.written(run_id)
        for path, form in (
            ("tasks/transform/clear", {"downstream": "1"}),
            ("tasks/transform/mark", {"state": "success"}),
            ("rerun", {}),
        ):
            for extra in ({"Origin": "http://127.0.0.1:8000"}, {"Sec-Fetch-Site": "cross-site"}):
                for prefix in ("", "/api"):
                    refused = self.post(f"{prefix}/runs/{run_id}/{path}", {"_xsrf": token, **form}, **extra, **headers)
                    assert refused.code == 403, (prefix, path, extra)
        assert self.written(run_id) == before
        own = {"Origin": "http://127.0.0.1", "Sec-Fetch-Site": "same-origin"}
        done = self.post(f"/runs/{run_id}/tasks/transform/mark", {"_xsrf": token, "state": "success"}, **own, **headers)
        assert done.code == 303


class TestBasicAuth(WebCase):
    auth = "admin:pa55word-long"
    bind = "0.0.0.0"

    def test_every_page_needs_the_password(self) -> None:
        run_id = self.failed_run()
        anonymous = self.get("/runs")
        assert anonymous.code == 401 and anonymous.headers["WWW-Authenticate"].startswith("Basic")
        assert self.get("/api/runs", **basic("admin", "nope")).code == 401
        assert self.get("/metrics").code == 401
        assert self.get("/healthz").code == 200
        right = basic("admin", "pa55word-long")
        assert self.get(f"/runs/{run_id}", **right).code == 200
        token, headers = self.xsrf(**right)
        assert self.post(f"/api/runs/{run_id}/tasks/b/retry", **right).code == 403  # basic auth still needs XSRF
        assert self.post(f"/api/runs/{run_id}/tasks/b/retry", {"_xsrf": token}, **headers).code == 200
        by = [e.by for e in self.orc.run(run_id).events() if e.actor == "operator"]
        assert len(by) >= 1 and set(by) == {"admin (web from 127.0.0.1)"}
        # a foreign Host or a proxy's header neither grants nor denies: the password decides
        assert self.get("/api/runs", Host="orc.example", **right).code == 200
        assert self.get("/api/runs", Host="orc.example", **{"X-Forwarded-For": "10.0.0.1"}).code == 401


class TestToken(WebCase):
    auth = TOKEN
    bind = "0.0.0.0"

    def test_bearer_for_scripts_and_a_login_form_for_people(self) -> None:
        run_id = self.failed_run()
        assert self.generated == ""  # configured credentials: nothing made at start
        assert self.get("/api/runs").code == 401
        page = self.get(f"/runs/{run_id}")
        assert page.code == 302 and page.headers["Location"].startswith("/login?next=")
        assert self.get("/api/runs", **bearer(TOKEN)).code == 200
        # a bearer request needs no XSRF token: a browser never sends that header on its own
        done = self.post(f"/api/runs/{run_id}/tasks/b/retry", **bearer(TOKEN))
        assert done.code == 200 and json.loads(done.body)["ok"] is True
        token, headers = self.xsrf()
        bad = self.post("/login", {"_xsrf": token, "token": "wrong", "next": "/runs"}, **headers)
        assert bad.code == 401 and "orc_user" not in bad.headers.get("Set-Cookie", "")
        good = self.post("/login", {"_xsrf": token, "token": TOKEN, "next": f"/runs/{run_id}"}, **headers)
        assert good.code == 302 and good.headers["Location"] == f"/runs/{run_id}"
        session = re.search(r"orc_user=([^;]+)", good.headers["Set-Cookie"])
        assert session is not None
        assert self.get(f"/runs/{run_id}", Cookie=f"orc_user={session.group(1)}").code == 200
        # the configured token logs in through the URL too
        assert self.get(f"/runs/{run_id}", Cookie=self.log_in(TOKEN)).code == 200
        # an open redirect through ?next= is refused
        for elsewhere in ("//evil.example/", "/\\evil.example", "https://evil.example/", "/runs\r\nX: y"):
            away = self.post("/login", {"_xsrf": token, "token": TOKEN, "next": elsewhere}, **headers)
            assert away.headers["Location"] == "/runs", elsewhere


ACME_TOKEN = "acme-token-0123456789abcdef"
TENANTS_AUTH = f"root:rootpass-long, alice:alice-pass-long=acme, bob:bob-pass-long1=bravo, {ACME_TOKEN}=acme, {TOKEN}=*"


class TestTenantBound(WebCase):
    """One serve, several tenants: a tenant-bound credential sees and acts on its tenant only."""

    auth = TENANTS_AUTH
    bind = "0.0.0.0"

    def test_each_tenant_sees_only_its_own(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        mine, theirs = self.failed_run("acme"), self.failed_run("bravo")
        token, xsrf_headers = self.xsrf()
        for who in (basic("alice", "alice-pass-long"), bearer(ACME_TOKEN), {"Cookie": self.log_in(ACME_TOKEN)}):
            self.session = who
            # lists hold the tenant's runs only, whatever the filter asks
            assert [r["id"] for r in json.loads(self.get("/api/runs").body)["runs"]] == [mine]
            assert json.loads(self.get("/api/runs?tenant=bravo").body)["runs"] == []
            listing = self.get("/runs")
            assert listing.code == 200 and mine.encode() in listing.body and theirs.encode() not in listing.body
            # every read of another tenant's run: 404, exactly like a run that does not exist
            for path in (f"/runs/{theirs}", f"/api/runs/{theirs}", f"/api/runs/{theirs}/graph?format=dot"):
                assert self.get(path).code == 404, path
                assert self.get(path.replace(theirs, mine)).code == 200, path
            nope = json.loads(self.get(f"/api/runs/{theirs}").body)
            assert nope == json.loads(self.get("/api/runs/nope").body) | {"error": f"no run with id {theirs!r}"}
            # and every action
            for path in (
                f"/runs/{theirs}/cancel",
                f"/runs/{theirs}/tasks/b/retry",
                f"/api/runs/{theirs}/cancel",
                f"/api/runs/{theirs}/tasks/b/retry",
                f"/api/runs/{theirs}/tasks/b/skip",
                f"/api/runs/{theirs}/tasks/b/fail",
                f"/runs/{theirs}/tasks/b/clear",
                f"/runs/{theirs}/tasks/b/mark",
                f"/runs/{theirs}/rerun",
                f"/api/runs/{theirs}/tasks/b/clear",
                f"/api/runs/{theirs}/tasks/b/mark",
                f"/api/runs/{theirs}/rerun",
            ):
                cookie = " ".join(v for k, v in xsrf_headers.items() if k == "Cookie")
                acted = self.post(path, {"_xsrf": token, "state": "success", "downstream": "1"}, Cookie=cookie)
                assert acted.code == 404, (path, acted.code)
            # /metrics: the tenant's families only
            scrape = self.get("/metrics")
            assert scrape.code == 200
            tenants = {
                s.labels["tenant"]
                for f in text_string_to_metric_families(scrape.body.decode())
                for s in f.samples
                if "tenant" in s.labels
            }
            assert tenants == {"acme"}, tenants
        assert self.orc.run(theirs).state.value == "FAILED"
        assert not [e for e in self.orc.run(theirs).events() if e.actor == "operator"]
        assert {t.attempt for t in self.orc.tasks(theirs)} == {1}
        assert len(self.orc.runs(100)) == 2  # no rerun made
        # its own run: it acts, and the ledger says who
        self.session = basic("alice", "alice-pass-long")
        done = self.post(f"/api/runs/{mine}/tasks/b/retry", {"_xsrf": token}, **xsrf_headers)
        assert done.code == 200, done.body
        assert {e.by for e in self.orc.run(mine).events() if e.actor == "operator"} == {"alice (web from 127.0.0.1)"}
        # bob sees bravo's and not acme's; the admins see both
        self.session = basic("bob", "bob-pass-long1")
        assert [r["id"] for r in json.loads(self.get("/api/runs").body)["runs"]] == [theirs]
        assert self.get(f"/runs/{mine}").code == 404
        for admin in (basic("root", "rootpass-long"), bearer(TOKEN)):
            self.session = admin
            assert {r["id"] for r in json.loads(self.get("/api/runs").body)["runs"]} == {mine, theirs}
            assert self.get(f"/runs/{theirs}").code == 200
        # a password is checked with its user: alice's password is not bob's
        assert self.get("/api/runs", anonymous=True, **basic("bob", "alice-pass-long")).code == 401
        # clear, mark and rerun of its own run too, as alice
        self.session = basic("alice", "alice-pass-long")
        finish(self.orc, fail={"b"})
        cleared = self.post(f"/runs/{mine}/tasks/a/clear", {"_xsrf": token, "downstream": "1"}, **xsrf_headers)
        assert cleared.code == 303, cleared.body
        marked = self.post(f"/api/runs/{mine}/tasks/d/mark", {"_xsrf": token, "state": "failed"}, **xsrf_headers)
        assert marked.code == 200, marked.body
        assert {e.by for e in self.orc.run(mine).events() if e.actor == "operator"} == {"alice (web from 127.0.0.1)"}
        again = self.post(f"/runs/{mine}/rerun", {"_xsrf": token}, **xsrf_headers)
        assert again.code == 303 and self.orc.run(again.headers["Location"][6:]).status().tenant == "acme"


def test_credentials_are_checked_at_start(tmp_path: Path) -> None:
    creds = parse_ui_auth(TENANTS_AUTH)
    assert [(c.kind, c.name, c.tenant) for c in creds] == [
        ("basic", "root", None),
        ("basic", "alice", "acme"),
        ("basic", "bob", "bravo"),
        ("token", "token@acme", "acme"),
        ("token", "token", None),
    ]
    assert parse_ui_auth("u:p=ss=*")[0].secret == "p=ss"  # a secret with '=' ends with =* or =TENANT
    assert parse_ui_auth("") == ()
    bad = {
        "   ": "blank",
        "admin: ": "password is blank",
        "admin:   =acme": "password is blank",
        "admin:\t": "password is blank",
        "a:secret-one,,b:secret-two": "entry 2 is empty",
        "a:secret-one,a:secret-two": "appears twice",
        ":secret-one": "user name is empty",
        "short": "at least 16",
        "has space in the token": "no spaces",
        "a:secret-one=bad tenant!": "neither '*' nor a tenant",
        "a:secret-one=": "neither '*' nor a tenant",
    }
    for raw, why in bad.items():
        with pytest.raises(ConfigurationError, match=re.escape(why)) as caught:
            parse_ui_auth(raw)
        message = str(caught.value)
        assert message.startswith("ORCHESTRATOR_UI_AUTH"), message
        assert "secret-one" not in message and "secret-two" not in message, message
    orc = make_orc(tmp_path)
    try:
        # no credentials: refused on any bind that is not loopback, a token made on loopback
        for public in ("0.0.0.0", "::", "10.0.0.5", ""):
            with pytest.raises(ConfigurationError, match="ORCHESTRATOR_UI_AUTH is not set"):
                make_app(orc, auth="", bind=public)
        access = make_app(orc, auth="", bind="127.0.0.1").settings["access"]
        assert len(access.generated) >= 40 and access.credentials[0].tenant is None
        assert access.generated != make_app(orc, auth="", bind="::1").settings["access"].generated
        with pytest.raises(ConfigurationError, match="password is blank"):
            make_app(orc, auth="admin: ", bind="0.0.0.0")
        # a serve bound to one tenant cannot hand out another tenant's credentials
        bound = Orchestrator(
            orc.settings, store=orc.store, publisher=orc.publisher, registry=orc.registry, tenant="acme"
        )
        assert make_app(bound, auth=f"{ACME_TOKEN}=acme", bind="0.0.0.0") is not None
        with pytest.raises(ConfigurationError, match="acts as tenant 'acme' only"):
            make_app(bound, auth=f"{ACME_TOKEN}=bravo", bind="0.0.0.0")
    finally:
        orc.store.dispose()


def test_loopback_addresses() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.9.9.9")
    for public in ("", "0.0.0.0", "::", "10.0.0.5", "example.com", "[::]"):
        assert not is_loopback(public), public
    assert Access("", "127.0.0.1").generated and Access(TOKEN, "0.0.0.0").generated == ""


# ------------------------------------------------------------------ orchestrator serve, the process


def _serve_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_") or k.startswith("ORCHESTRATOR_TEST")
    }
    env.update(ORCHESTRATOR_DATA_DIR=str(tmp), **extra)
    return env


def test_serve_refuses_a_public_bind_without_credentials(tmp_path: Path) -> None:
    for argv, env, needle in (
        (["--host", "0.0.0.0"], {}, "ORCHESTRATOR_UI_AUTH is not set"),
        (["--host", "::"], {}, "ORCHESTRATOR_UI_AUTH is not set"),
        (["--host", "0.0.0.0"], {"ORCHESTRATOR_UI_AUTH": "admin:  "}, "password is blank"),
        (["--host", "127.0.0.1"], {"ORCHESTRATOR_UI_AUTH": "  "}, "is blank"),
        (["--host", "0.0.0.0"], {"ORCHESTRATOR_UI_AUTH": "admin:short-pw11"}, "at least 12 characters"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "serve", *argv, "--port", "1"],
            env=_serve_env(tmp_path, **env),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, (argv, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0] and "ORCHESTRATOR_UI_AUTH" in lines[0], done.stderr
        assert not (tmp_path / "pg").exists()  # refused before the database was touched


def test_serve_prints_a_login_url_and_needs_its_token(tmp_path: Path) -> None:
    import socket
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    log = tmp_path / "serve.log"
    env = _serve_env(tmp_path, ORCHESTRATOR_DATABASE_URL=clean_test_database())
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while not (found := re.search(r"(http://127\.0\.0\.1:\d+/login\?token=([A-Za-z0-9_-]+))", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        url, token = found.group(1), found.group(2)
        assert url == f"http://127.0.0.1:{port}/login?token={token}" and len(token) >= 40

        class NoRedirect(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, *args: Any, **kwargs: Any) -> None:
                return None

        opener = urllib.request.build_opener(NoRedirect)

        def status(path: str, **headers: str) -> tuple[int, Any]:
            try:
                with opener.open(urllib.request.Request(path, headers=headers), timeout=10) as r:
                    return r.status, r.headers
            except urllib.error.HTTPError as e:
                return e.code, e.headers

        base = f"http://127.0.0.1:{port}"
        assert status(base + "/api/runs")[0] == 401 and status(base + "/metrics")[0] == 401
        assert status(base + "/runs")[0] == 302
        assert status(base + "/api/runs", Authorization=f"Bearer {token}")[0] == 200
        assert status(base + "/login?token=wrong-" + token, **{"Sec-Fetch-Site": "none"})[0] == 403
        code, headers = status(url, **{"Sec-Fetch-Site": "none"})  # typed or opened from the terminal
        assert code == 302 and headers["Location"] == "/runs" and "orc_user=" in headers["Set-Cookie"]
        cookie = headers["Set-Cookie"].split(";")[0]
        assert status(base + "/runs", Cookie=cookie)[0] == 200
        # a request line too long for the limit is answered, not dropped
        assert status(base + "/runs?q=" + "a" * 100_000)[0] == 414
    finally:
        stop_process(proc)


# ------------------------------------------------------------------ drawing


def test_layout_layers_follow_the_longest_path() -> None:
    tasks = [drawing.TaskInfo(k, "t", "PENDING") for k in "abcde"]
    edges = [("a", "b"), ("b", "c"), ("a", "c"), ("d", "e")]
    assert drawing.layers("abcde", edges) == {"a": 0, "b": 1, "c": 2, "d": 0, "e": 1}
    g = drawing.layout(tasks, edges)
    xs = {b.keys[0]: b.x for b in g.boxes}
    assert xs["a"] < xs["b"] < xs["c"] and xs["a"] == xs["d"] and xs["b"] == xs["e"]
    assert len(g.arrows) == 4 and len({(b.x, b.y) for b in g.boxes}) == 5  # no two boxes overlap


def test_large_dags_collapse_wide_layers() -> None:
    keys = ["root"] + [f"m{i:03d}" for i in range(400)] + ["sink"]
    states = {k: "SUCCEEDED" for k in keys} | {"m007": "FAILED"}
    tasks = [drawing.TaskInfo(k, "t", states[k]) for k in keys]
    edges = [("root", k) for k in keys[1:-1]] + [(k, "sink") for k in keys[1:-1]]
    g = drawing.layout(tasks, edges)
    assert len(g.boxes) == 3
    middle = next(b for b in g.boxes if b.collapsed)
    assert middle.counts == {"FAILED": 1, "SUCCEEDED": 399} and middle.state == "MIXED"
    assert len(g.arrows) == 2 and g.height < 200
    svg = drawing.to_svg(g)
    assert 'class="node collapsed" data-keys="400"' in svg
    # under the threshold every task is drawn
    small = drawing.layout(tasks[:200], edges[:199])
    assert len(small.boxes) == 200


def test_svg_escapes_and_links() -> None:
    g = drawing.layout([drawing.TaskInfo("a", "<script>", "RUNNING", "one_failed", 2)], [])
    svg = drawing.to_svg(g, href=lambda key: f"#task-{key}")
    assert "<script>" not in svg and "&lt;script&gt;" in svg and 'href="#task-a"' in svg
    assert "running #2" in svg and "one_failed" in svg


@pytest.fixture
def pg_orc(tmp_path: Path) -> Iterator[Orchestrator]:
    orc = make_orc(tmp_path)
    yield orc
    orc.store.dispose()


def test_graph_command_writes_each_format(
    pg_orc: Orchestrator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from orchestrator.cli import app as cli
    from orchestrator.cli import base as cli_base

    run = pg_orc.submit(diamond())
    finish(pg_orc, fail={"b"})
    monkeypatch.setattr(cli_base, "_ready_store", lambda: pg_orc)
    for fmt, marker in (("svg", "<svg"), ("dot", "digraph"), ("mermaid", "flowchart LR")):
        out = tmp_path / f"g.{fmt}"
        result = CliRunner().invoke(cli.main, ["graph", run.id, "--format", fmt, "-o", str(out)])
        assert result.exit_code == 0, result.output
        assert out.read_text().lstrip().startswith(marker)
    missing = CliRunner().invoke(cli.main, ["graph", "nope"])
    assert missing.exit_code == 2 and "no run with id" in missing.output


def test_submit_warns_and_status_shows_maps_and_skips(
    pg_orc: Orchestrator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from orchestrator.cli import app as cli
    from orchestrator.cli import base as cli_base
    from tests.store.dynamic import drive

    monkeypatch.setattr(cli_base, "_ready_store", lambda: pg_orc)
    spec = tmp_path / "branch.json"
    spec.write_text(
        json.dumps(
            {
                "name": "warned",
                "nodes": [
                    {"key": "pick", "task": "t.ok", "branch": True},
                    {"key": "a", "task": "t.ok", "upstream": ["pick"]},
                    {"key": "b", "task": "t.ok", "upstream": ["pick"]},
                    {"key": "join", "task": "t.ok", "upstream": ["a", "b"]},
                ],
            }
        )
    )
    submitted = CliRunner().invoke(cli.main, ["submit", str(spec)])
    assert submitted.exit_code == 0, submitted.output
    assert len(submitted.stdout.split()) == 1  # the run id alone on stdout
    assert submitted.stderr.startswith("warning: ") and "'join' joins branches of 'pick'" in submitted.stderr
    dag = DAG("shown")
    dag.task("ls", "t.ok")
    dag.map("m", "t.ok", over="ls", kwarg="x")
    dag.task("pick", "t.ok", branch=True)
    dag.task("left", "t.ok", upstream=["pick"])
    dag.task("right", "t.ok", upstream=["pick"])
    d = drive(pg_orc, dag, lambda k, kw, up: [1, 2, 3] if k == "ls" else "left" if k == "pick" else 1)
    out = CliRunner().invoke(cli.main, ["status", d.run_id])
    assert out.exit_code == 0, out.output
    lines = {line.split()[0]: line for line in out.output.splitlines()[2:]}
    assert "SKIPPED (branch_not_taken)" in lines["right"]
    assert "SUCCEEDED 3/3 done: 3 ok, 0 failed, 0 skipped" in lines["m"]
    assert "SUCCEEDED (item 1 of m)" in lines["m[1]"]
    doc = json.loads(CliRunner().invoke(cli.main, ["status", d.run_id, "--json"]).output)
    tasks = {t["key"]: t for t in doc["tasks"]}
    assert tasks["right"]["skip_reason"] == "branch_not_taken" and tasks["m"]["map"]["total"] == 3
    assert tasks["m[2]"]["map_parent"] == "m"
    # the drawing of the CLI: one box for the map
    mermaid = CliRunner().invoke(cli.main, ["graph", d.run_id, "--format", "mermaid"]).output
    assert "m \u00d73<br/>3 ok" in mermaid and "m[" not in mermaid and "skipped: branch_not_taken" in mermaid


def gate(name: str = "gate") -> DAG:
    """An approval node and a wait for the event ``go``, then a task after both."""
    dag = DAG(name)
    dag.approval("ok")
    dag.wait("go", event="go", match={"n": 1})
    dag.task("after", "t.ok", upstream=["ok", "go"])
    return dag


class TestWaitsAndEvents(WebCase):
    """A WAITING task on the run page (its colour, what it waits for), Approve / Reject (as the
    other actions: XSRF, ``by``, a refusal that writes nothing), and ``POST /api/events``."""

    auth = TENANTS_AUTH
    bind = "0.0.0.0"

    def emit(self, doc: Any, **headers: str) -> Any:
        body = doc if isinstance(doc, (str, bytes)) else json.dumps(doc)
        return self.fetch(
            "/api/events", method="POST", body=body,
            headers=self._headers({"Content-Type": "application/json", **headers}, True), follow_redirects=False,
        )  # fmt: skip

    def test_approve_and_reject_from_the_run_page_and_the_api(self) -> None:
        run = self.orc.submit(gate())
        self.session = {"Cookie": self.log_in(TOKEN)}
        html = self.get(f"/runs/{run.id}").body.decode()
        row = html.split('<tr id="task-ok"')[1].split("</tr>")[0]
        assert 'data-state="WAITING"' in row
        assert f'action="/runs/{run.id}/tasks/ok/approve"' in row and f'action="/runs/{run.id}/tasks/ok/reject"' in row
        go = html.split('<tr id="task-go"')[1].split("</tr>")[0]
        assert "/approve" not in go and "go" in go  # an event wait: no approval buttons
        assert drawing.COLOURS["WAITING"] in html  # the legend (and the drawing) colour WAITING
        doc = json.loads(self.get(f"/api/runs/{run.id}").body)
        waits = {t["key"]: t.get("waiting") for t in doc["tasks"]}
        assert waits["ok"]["kind"] == "approval" and waits["go"]["event"] == "go" and waits["after"] is None
        token, headers = self.xsrf()
        assert self.post(f"/runs/{run.id}/tasks/ok/approve", {"comment": "x"}).code == 403  # no XSRF
        assert self.orc.task(run.id, "ok").state.value == "WAITING"
        done = self.post(f"/runs/{run.id}/tasks/ok/approve", {"_xsrf": token, "comment": "ship it"}, **headers)
        assert done.code == 303 and done.headers["Location"] == f"/runs/{run.id}", done.body
        ok = self.orc.task(run.id, "ok")
        assert ok.state.value == "SUCCEEDED" and ok.waiting is None
        assert ok.result["approved"] is True and ok.result["comment"] == "ship it"
        assert ok.result["by"].endswith("(web from 127.0.0.1)")
        # answered already: a named refusal that writes nothing
        before = len(self.orc.ledger(run.id))
        again = self.post(f"/api/runs/{run.id}/tasks/ok/reject", {"_xsrf": token}, **headers)
        assert again.code == 400 and "not waiting for an approval" in json.loads(again.body)["error"]
        assert len(self.orc.ledger(run.id)) == before
        other = self.orc.submit(gate("gate2"))
        api = self.post(f"/api/runs/{other.id}/tasks/ok/reject", {"_xsrf": token, "comment": "no"}, **headers)
        assert api.code == 200, api.body
        assert json.loads(api.body) | {"done": ""} == {
            "ok": True, "run": other.id, "key": "ok", "action": "reject", "done": "", "comment": "no",
        }  # fmt: skip
        assert self.orc.task(other.id, "ok").state.value == "FAILED"

    def test_post_api_events_emits_as_the_credentials_tenant(self) -> None:
        mine = self.orc.submit(gate(), tenant="acme")
        theirs = self.orc.submit(gate(), tenant="bravo")
        done = self.emit({"key": "go", "payload": {"n": 1}, "event_id": "e1"}, **bearer(ACME_TOKEN))
        assert done.code == 200, done.body
        answer = json.loads(done.body)
        assert answer | {"id": 0} == {"ok": True, "id": 0, "event_id": "e1", "duplicate": False, "woken": 1}
        assert self.orc.task(mine.id, "go").state.value != "WAITING"
        assert self.orc.task(theirs.id, "go").state.value == "WAITING"  # another tenant's wait
        twice = json.loads(self.emit({"key": "go", "payload": {"n": 1}, "event_id": "e1"}, **bearer(ACME_TOKEN)).body)
        assert twice["duplicate"] is True and twice["woken"] == 0
        refused = self.emit({"key": "go", "tenant": "bravo"}, **bearer(ACME_TOKEN))
        assert refused.code == 403 and "acme" in json.loads(refused.body)["error"]
        for bad in ({"key": "bad key!"}, {"key": "go", "payload": [1]}, {"key": "go", "when": 1}, "[1]", "{nope"):
            answer = self.emit(bad, **bearer(ACME_TOKEN))
            assert answer.code == 400 and json.loads(answer.body)["error"], (bad, answer.body)
        assert self.emit({"key": "go"}).code == 401  # no credential
        # a credential for every tenant names the tenant (else: default)
        admin = self.emit({"key": "go", "payload": {"n": 1}, "tenant": "bravo"}, **bearer(TOKEN))
        assert admin.code == 200 and json.loads(admin.body)["woken"] == 1
        assert self.orc.task(theirs.id, "go").state.value != "WAITING"
        events = self.orc.store.waits.events(None)
        assert {e.tenant for e in events} == {"acme", "bravo"}
        assert all("(web from 127.0.0.1)" in (e.by or "") for e in events)
