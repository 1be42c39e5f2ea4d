"""Runs of any size in the browser (issue 18, item 3): the run page and ``/api/runs/RUN_ID`` of
a run of a few thousand tasks are paged and bounded, the drawing collapses wide layers and long
chains into counted groups, paging and the key search find any task, and
``/api/runs/RUN_ID/changes?after=ID`` answers only what changed since a ledger id. On the
Postgres test database, through Tornado's test client (a real socket)."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import sqlalchemy as sa

from orchestrator import DAG
from orchestrator import graph as drawing
from orchestrator.publisher import RecordingPublisher
from orchestrator.web import API_LIMIT, CHANGES_LIMIT, LEDGER_ROWS, TASK_ROWS
from tests.unit.test_web import TOKEN, WebCase, bearer

WIDTH = 3_000


def wide(n: int = WIDTH) -> DAG:
    """``root`` -> ``m00000`` ... -> ``sink``: ``n`` tasks, the middle layer ``n - 2`` wide."""
    dag = DAG("wide")
    root = dag.task("root", "t.ok")
    middle = [dag.task(f"m{i:05d}", "t.ok", upstream=[root]) for i in range(n - 2)]
    dag.task("sink", "t.ok", upstream=middle)
    return dag


class TestRunPage(WebCase):
    auth = TOKEN

    def setUp(self) -> None:
        super().setUp()
        self.session = {"Cookie": self.log_in(TOKEN)}

    def api(self, path: str) -> dict[str, Any]:
        r = self.get(path, **bearer(TOKEN))
        assert r.code == 200, (r.code, r.body[:300])
        return json.loads(r.body)  # type: ignore[no-any-return]

    def settle(self, run_id: str, *, failed: int = 10) -> None:
        """Move the middle layer in bulk: SUCCEEDED but ``failed`` of them FAILED."""
        with self.orc.store.db.engine.begin() as conn:
            conn.execute(
                sa.text("UPDATE orc_tasks SET state = 'SUCCEEDED' WHERE run_id = :r AND key LIKE 'm%'"), {"r": run_id}
            )
            conn.execute(
                sa.text("UPDATE orc_tasks SET state = 'FAILED', error = 'boom' WHERE run_id = :r AND key < :k"),
                {"r": run_id, "k": f"m{failed:05d}"},
            )

    def test_the_page_is_bounded_and_draws_counted_groups(self) -> None:
        run = self.orc.submit(wide())
        self.settle(run.id)
        page = self.get(f"/runs/{run.id}")
        assert page.code == 200
        html = page.body.decode()
        assert len(page.body) < 200_000, len(page.body)
        assert 'http-equiv="refresh"' not in html  # no reload: /static/run.js polls the changes
        assert '<script src="/static/run.js"' in html
        # a large run's first view comes without its drawing, which the script fetches
        assert f'data-src="/runs/{run.id}?part=dag"' in html and 'class="node' not in html
        dag = self.get(f"/runs/{run.id}?part=dag")
        assert dag.code == 200 and dag.headers["Content-Type"].startswith("image/svg+xml")
        assert dag.body.decode().count('class="node') == 3
        assert self.get(f"/runs/{run.id}?part=dag", anonymous=True).code == 302  # to the login page
        # later views have it inline: root, one counted box of the middle layer, sink
        page = self.get(f"/runs/{run.id}")
        html = page.body.decode()
        assert "data-src=" not in html and html.count('class="node') == 3
        assert html.count('class="node collapsed"') == 1
        assert f'data-keys="{WIDTH - 2}"' in html and "FAILED:10,SUCCEEDED:2988" in html
        assert "2,998 tasks: 2,988 SUCCEEDED, 10 FAILED" in html
        # one page of the table and of the ledger
        assert len(re.findall(r'<tr id="task-', html)) == TASK_ROWS
        assert len(re.findall(r"<tr data-id=", html)) <= LEDGER_ROWS
        assert 'id="tasks-next"' in html
        script = self.get("/static/run.js")
        assert script.code == 200 and b"/changes?after=" in script.body
        assert self.get("/static/run.js", anonymous=True).code == 401

    def test_paging_and_search_find_any_task(self) -> None:
        run = self.orc.submit(wide())
        self.settle(run.id)
        # the page's table: the search finds one task, the state filter the failed ones
        found = self.get(f"/runs/{run.id}?q=m01234").body.decode()
        assert re.findall(r'<tr id="task-([^"]+)"', found) == ["m01234"]
        failed = self.get(f"/runs/{run.id}?state=failed").body.decode()
        assert re.findall(r'<tr id="task-([^"]+)"', failed) == [f"m{i:05d}" for i in range(10)]
        assert self.get(f"/runs/{run.id}?state=DONE").code == 400
        assert self.get(f"/runs/{run.id}?limit=5000").code == 400
        # following "next" walks every task once, in key order
        seen: list[str] = []
        path: str | None = f"/runs/{run.id}?limit=1000"
        while path:
            html = self.get(path).body.decode()
            seen += re.findall(r'<tr id="task-([^"]+)"', html)
            nxt = re.search(r'id="tasks-next" href="([^"]+)"', html)
            path = nxt.group(1).replace("&amp;", "&") if nxt else None
        assert len(seen) == WIDTH and seen == sorted(seen) and len(set(seen)) == WIDTH
        # and back: "previous" from the second page is the first
        second = self.get(f"/runs/{run.id}?after={seen[99]}").body.decode()
        prev = re.search(r'id="tasks-prev" href="([^"]+)"', second)
        assert prev is not None
        first = self.get(prev.group(1).replace("&amp;", "&")).body.decode()
        assert re.findall(r'<tr id="task-([^"]+)"', first) == seen[:TASK_ROWS]
        # the JSON: the same pages
        doc = self.api(f"/api/runs/{run.id}?q=m02999&limit=10")
        assert [t["key"] for t in doc["tasks"]] == [] and doc["next"]["tasks"] is None
        doc = self.api(f"/api/runs/{run.id}?q=M0299")
        assert [t["key"] for t in doc["tasks"]] == [f"m0299{i}" for i in range(8)]
        assert self.api(f"/api/runs/{run.id}?q=%25")["tasks"] == []  # LIKE's wildcards are literal

    def test_the_api_pages_with_a_default_limit(self) -> None:
        run = self.orc.submit(wide())
        self.settle(run.id)
        doc = self.api(f"/api/runs/{run.id}")
        assert len(doc["tasks"]) == API_LIMIT and len(doc["edges"]) == API_LIMIT
        assert doc["counts"]["SUCCEEDED"] == 2988 and doc["counts"]["FAILED"] == 10
        assert doc["page"]["limit"] == API_LIMIT and len(json.dumps(doc)) < 1_000_000
        keys: list[str] = []
        edges: list[list[str]] = []
        path: str | None = f"/api/runs/{run.id}"
        while path:
            doc = self.api(path)
            keys += [t["key"] for t in doc["tasks"]]
            path = doc["next"]["tasks"]
        assert len(keys) == WIDTH == len(set(keys))
        path = f"/api/runs/{run.id}?limit=1000"
        while path:
            doc = self.api(path)
            edges += doc["edges"]
            path = doc["next"]["edges"]
        assert len(edges) == 2 * (WIDTH - 2) == len({tuple(e) for e in edges})
        assert self.get(f"/api/runs/{run.id}?limit=1001", **bearer(TOKEN)).code == 400
        assert self.get(f"/api/runs/{run.id}?events=5001", **bearer(TOKEN)).code == 400
        assert self.get(f"/api/runs/{run.id}?edges_after=nodot", **bearer(TOKEN)).code == 400

    def test_the_ledger_is_paged(self) -> None:
        run = self.orc.submit(wide(400))
        self.finish_all()
        doc = self.api(f"/api/runs/{run.id}?events=100")
        ids = [e["id"] for e in doc["events"]]
        assert len(ids) == 100 and ids == sorted(ids) and doc["page"]["last_event"] == ids[-1]
        every: list[int] = []
        path: str | None = f"/api/runs/{run.id}?events=100&limit=1"
        while path:
            doc = self.api(path)
            every = [e["id"] for e in doc["events"]] + every
            path = doc["next"]["events"]
        assert every == sorted(set(every)) and len(every) == len(run.events()) > 1000
        html = self.get(f"/runs/{run.id}").body.decode()
        older = re.search(r'id="ledger-older" href="([^"]+)"', html)
        assert older is not None
        page2 = self.get(older.group(1).replace("&amp;", "&")).body.decode()
        shown = [int(i) for i in re.findall(r'<tr data-id="(\d+)"', page2)]
        assert shown == every[-2 * LEDGER_ROWS : -LEDGER_ROWS] and 'data-frozen="1"' in page2

    def finish_all(self) -> None:
        publisher = self.orc.publisher
        assert isinstance(publisher, RecordingPublisher)
        while batch := publisher.take():
            for d in batch:
                assert self.orc.claim(d.token, "w:1", d.task_name) is not None
                self.orc.complete(d.token, {"key": d.key})

    def test_changes_answer_only_what_changed(self) -> None:
        run = self.orc.submit(wide())
        doc = self.api(f"/api/runs/{run.id}?limit=1&events=1")
        last = doc["page"]["last_event"]
        assert doc["next"]["changes"] == f"/api/runs/{run.id}/changes?after={last}"
        quiet = self.api(f"/api/runs/{run.id}/changes?after={last}")
        assert quiet["events"] == [] and quiet["tasks"] == {} and quiet["boxes"] == {}
        assert quiet["last"] == last and quiet["more"] is False and quiet["run"]["state"] == "RUNNING"
        # the root runs and succeeds: its children become ready, nothing else moves
        publisher = self.orc.publisher
        assert isinstance(publisher, RecordingPublisher)
        (root,) = publisher.take()
        assert self.orc.claim(root.token, "w:1", root.task_name) is not None
        self.orc.complete(root.token, {"ok": True})
        changed: dict[str, str] = {}
        events: list[int] = []
        after, polls = last, 0
        while True:
            c = self.api(f"/api/runs/{run.id}/changes?after={after}")
            polls += 1
            assert len(c["events"]) <= CHANGES_LIMIT
            assert all(e["id"] > after for e in c["events"])
            events += [e["id"] for e in c["events"]]
            changed |= {k: t["state"] for k, t in c["tasks"].items()}
            assert set(c["tasks"]) == {e["key"] for e in c["events"] if e["key"]}
            for box in c["boxes"].values():
                assert sum(box["counts"].values()) == WIDTH - 2 and box["title"].startswith("2,998 tasks: ")
            after = c["last"]
            if not c["more"]:
                break
        assert polls > 1 and events == sorted(set(events))
        assert changed["root"] == "SUCCEEDED" and "sink" not in changed
        assert len(changed) == WIDTH - 1  # the root and every middle task, each once
        assert self.api(f"/api/runs/{run.id}/changes?after={after}")["events"] == []
        assert self.get(f"/api/runs/{run.id}/changes?after=-1", **bearer(TOKEN)).code == 400
        assert self.get(f"/api/runs/{run.id}/changes?after=0", anonymous=True).code == 401
        assert self.get("/api/runs/nope/changes?after=0", **bearer(TOKEN)).code == 404


def test_chains_and_wide_layers_collapse_from_the_edges() -> None:
    # a chain of 1,000 is one box
    keys = [f"c{i:04d}" for i in range(1000)]
    g = drawing.layout([drawing.TaskInfo(k, "t", "SUCCEEDED") for k in keys], list(itertools.pairwise(keys)))
    assert [(b.kind, len(b.keys)) for b in g.boxes] == [("chain", 1000)]
    assert drawing.counted(g.boxes[0]) == "chain of 1,000 tasks: 1,000 SUCCEEDED"
    # 400 parallel chains of 5 under one root: one counted box
    keys, edges = ["r"], []
    for c in range(400):
        prev = "r"
        for i in range(5):
            keys.append(f"c{c}_{i}")
            edges.append((prev, keys[-1]))
            prev = keys[-1]
    g = drawing.layout([drawing.TaskInfo(k, "t", "PENDING") for k in keys], edges)
    assert sorted(len(b.keys) for b in g.boxes) == [1, 2000]
    # two fan-outs in one layer stay two groups (their parents differ)
    keys = ["a", "b"] + [f"x{i}" for i in range(200)] + [f"y{i}" for i in range(200)]
    edges = [("a", f"x{i}") for i in range(200)] + [("b", f"y{i}") for i in range(200)]
    g = drawing.layout([drawing.TaskInfo(k, "t", "PENDING") for k in keys], edges)
    assert sorted(len(b.keys) for b in g.boxes) == [1, 1, 200, 200] and len(g.arrows) == 2
    # whatever the shape, the drawing is bounded: a deep ladder of 40,000 tasks
    keys, edges = [], []
    for i in range(20_000):
        keys += [f"a{i}", f"b{i}"]
        if i:
            edges += [(f"a{i - 1}", f"a{i}"), (f"b{i - 1}", f"b{i}"), (f"a{i - 1}", f"b{i}"), (f"b{i - 1}", f"a{i}")]
    g = drawing.layout([drawing.TaskInfo(k, "t", "PENDING") for k in keys], edges)
    assert len(g.boxes) <= drawing.MAX_BOXES and len(g.arrows) <= drawing.MAX_ARROWS
    assert sum(len(b.keys) for b in g.boxes) == 40_000
    assert len(drawing.to_svg(g)) < 1_000_000
