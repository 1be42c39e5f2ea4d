"""``orchestrator serve`` over HTTP (Tornado's test client, a real socket) on SQLite, and the
DAG drawing: pages, JSON, actions with XSRF, authentication, read-only binds, the Host check."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from tornado.testing import AsyncHTTPTestCase

from orchestrator import DAG, Orchestrator, Settings, TaskState, ValidationError
from orchestrator import graph as drawing
from orchestrator.publisher import RecordingPublisher
from orchestrator.registry import StaticRegistry
from orchestrator.routing import default_queues
from orchestrator.web import Access, is_loopback, make_app
from tests.conftest import clean_test_database

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


class WebCase(AsyncHTTPTestCase):
    auth = ""
    bind = "127.0.0.1"

    def setUp(self) -> None:
        import tempfile

        self.tmp = Path(tempfile.mkdtemp(prefix="orc-web-"))
        self.orc = make_orc(self.tmp)
        super().setUp()

    def tearDown(self) -> None:
        super().tearDown()
        self.orc.store.dispose()

    def get_app(self) -> Any:
        return make_app(self.orc, auth=self.auth, bind=self.bind, cookie_secret="test-secret")

    def get(self, path: str, **headers: str) -> Any:
        return self.fetch(path, headers={"Host": "127.0.0.1", **headers}, follow_redirects=False)

    def post(self, path: str, form: dict[str, str] | None = None, **headers: str) -> Any:
        body = urlencode(form or {})
        return self.fetch(
            path, method="POST", body=body, headers={"Host": "127.0.0.1", **headers}, follow_redirects=False
        )

    def xsrf(self, **headers: str) -> tuple[str, dict[str, str]]:
        """A page's XSRF token and the cookie that goes with it."""
        page = self.get("/login", **headers)
        assert page.code == 200, page.code
        cookie = re.search(r"_xsrf=([^;]+)", page.headers["Set-Cookie"])
        assert cookie is not None
        return cookie.group(1), {"Cookie": f"_xsrf={cookie.group(1)}", **headers}

    def failed_run(self) -> str:
        run = self.orc.submit(diamond())
        finish(self.orc, fail={"b"})
        return run.id


class TestLocal(WebCase):
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

    def test_actions_need_the_xsrf_token_and_are_audited(self) -> None:
        run_id = self.failed_run()
        assert self.post(f"/runs/{run_id}/tasks/b/retry").code == 403  # no token
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
        assert len(by) >= 1 and set(by) == {"anonymous (web from 127.0.0.1)"}
        # a refused action: 409 with the reason, and the refusal is in the ledger
        again = self.post(f"/api/runs/{run_id}/tasks/b/retry", {"_xsrf": token}, **headers)
        assert again.code == 409 and "only DEAD_LETTER or FAILED" in json.loads(again.body)["error"]
        cancelled = json.loads(self.post(f"/api/runs/{run_id}/cancel", {"_xsrf": token}, **headers).body)
        assert cancelled["ok"] is True and self.orc.run(run_id).state.value == "CANCELLED"

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

    def test_a_foreign_host_name_or_a_proxy_is_refused(self) -> None:
        # DNS rebinding: a page of evil.example resolving to 127.0.0.1 must not drive the app
        assert self.get("/runs", Host="evil.example:8080").code == 403
        assert self.get("/runs", Host="localhost:8080").code == 200
        # a reverse proxy on this host would open the unauthenticated app to its clients
        relayed = self.get("/api/runs", **{"X-Forwarded-For": "203.0.113.9"})
        assert relayed.code == 403 and "ORCHESTRATOR_UI_AUTH" in json.loads(relayed.body)["error"]


class TestReadOnly(WebCase):
    bind = "0.0.0.0"

    def test_no_auth_on_a_public_bind_is_read_only(self) -> None:
        run_id = self.failed_run()
        page = self.get(f"/runs/{run_id}", Host="orc.example")
        assert page.code == 200 and b"read-only" in page.body and b"/tasks/b/retry" not in page.body
        token, headers = self.xsrf(Host="orc.example")
        refused = self.post(f"/api/runs/{run_id}/tasks/b/retry", {"_xsrf": token}, **headers)
        assert refused.code == 403 and "read-only" in json.loads(refused.body)["error"]
        assert self.orc.run(run_id).task("b").state is TaskState.FAILED


class TestBasicAuth(WebCase):
    auth = "admin:pa55word"
    bind = "0.0.0.0"

    def test_every_page_needs_the_password(self) -> None:
        run_id = self.failed_run()
        anonymous = self.get("/runs")
        assert anonymous.code == 401 and anonymous.headers["WWW-Authenticate"].startswith("Basic")
        wrong = {"Authorization": "Basic " + base64.b64encode(b"admin:nope").decode()}
        assert self.get("/api/runs", **wrong).code == 401
        assert self.get("/metrics").code == 401
        assert self.get("/healthz").code == 200
        right = {"Authorization": "Basic " + base64.b64encode(b"admin:pa55word").decode()}
        assert self.get(f"/runs/{run_id}", **right).code == 200
        token, headers = self.xsrf(**right)
        assert self.post(f"/api/runs/{run_id}/tasks/b/retry", **right).code == 403  # basic auth still needs XSRF
        assert self.post(f"/api/runs/{run_id}/tasks/b/retry", {"_xsrf": token}, **headers).code == 200
        by = [e.by for e in self.orc.run(run_id).events() if e.actor == "operator"]
        assert len(by) >= 1 and set(by) == {"admin (web from 127.0.0.1)"}


class TestToken(WebCase):
    auth = TOKEN
    bind = "0.0.0.0"

    def test_bearer_for_scripts_and_a_login_form_for_people(self) -> None:
        run_id = self.failed_run()
        assert self.get("/api/runs").code == 401
        page = self.get(f"/runs/{run_id}")
        assert page.code == 302 and page.headers["Location"].startswith("/login?next=")
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert self.get("/api/runs", **bearer).code == 200
        # a bearer request needs no XSRF token: a browser never sends that header on its own
        done = self.post(f"/api/runs/{run_id}/tasks/b/retry", **bearer)
        assert done.code == 200 and json.loads(done.body)["ok"] is True
        token, headers = self.xsrf(**bearer)
        bad = self.post("/login", {"_xsrf": token, "token": "wrong", "next": "/runs"}, **headers)
        assert bad.code == 401
        good = self.post("/login", {"_xsrf": token, "token": TOKEN, "next": f"/runs/{run_id}"}, **headers)
        assert good.code == 302 and good.headers["Location"] == f"/runs/{run_id}"
        session = re.search(r"orc_user=([^;]+)", good.headers["Set-Cookie"])
        assert session is not None
        assert self.get(f"/runs/{run_id}", Cookie=f"orc_user={session.group(1)}").code == 200
        # an open redirect through ?next= is refused
        for elsewhere in ("//evil.example/", "/\\evil.example", "https://evil.example/", "/runs\r\nX: y"):
            away = self.post("/login", {"_xsrf": token, "token": TOKEN, "next": elsewhere}, **headers)
            assert away.headers["Location"] == "/runs", elsewhere


def test_loopback_addresses() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.9.9.9")
    for public in ("", "0.0.0.0", "::", "10.0.0.5", "example.com", "[::]"):
        assert not is_loopback(public), public
    assert Access("", "0.0.0.0").can_write is False and Access("", "127.0.0.1").can_write is True
    for bad in ("user:", ":pw", "short"):
        with pytest.raises(ValidationError):
            Access(bad, "127.0.0.1")


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

    from orchestrator import cli

    run = pg_orc.submit(diamond())
    finish(pg_orc, fail={"b"})
    monkeypatch.setattr(cli, "_ready_store", lambda: pg_orc)
    for fmt, marker in (("svg", "<svg"), ("dot", "digraph"), ("mermaid", "flowchart LR")):
        out = tmp_path / f"g.{fmt}"
        result = CliRunner().invoke(cli.main, ["graph", run.id, "--format", fmt, "-o", str(out)])
        assert result.exit_code == 0, result.output
        assert out.read_text().lstrip().startswith(marker)
    missing = CliRunner().invoke(cli.main, ["graph", "nope"])
    assert missing.exit_code == 2 and "no run with id" in missing.output
