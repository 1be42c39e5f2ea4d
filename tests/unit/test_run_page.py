"""Runs of any size in the browser (issue 18, item 3): the run page and ``/api/runs/RUN_ID`` of
a run of a few thousand tasks are paged and bounded, the drawing collapses wide layers and long
chains into counted groups, paging and the key search find any task, and
``/api/runs/RUN_ID/changes?after=ID`` answers only what changed since a ledger id. On the
Postgres test database, through Tornado's test client (a real socket)."""

from __future__ import annotations

import itertools
import json
import re
from html import unescape
from types import SimpleNamespace
from typing import Any
from urllib.parse import quote

import sqlalchemy as sa

from orchestrator import DAG
from orchestrator.core import graph as drawing
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.web.params import API_LIMIT, CHANGES_LIMIT, LEDGER_ROWS, TASK_ROWS
from tests.store.dynamic import Fail, drive
from tests.unit.test_web import TOKEN, WebCase, bearer, finish

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


# ------------------------------------------------------------------ dynamic DAGs on the run page


def mapped_dag(name: str = "maps", *, join: bool = True) -> DAG:
    """``ls`` -> map ``resize`` (one child per item) -> ``join``; a branch ``pick`` choosing
    ``left`` (``right`` SKIPPED: branch_not_taken)."""
    dag = DAG(name)
    dag.task("ls", "t.ok")
    dag.map("resize", "t.ok", over="ls", kwarg="x")
    if join:
        dag.task("join", "t.ok", upstream=["resize"], trigger_rule="all_done")
    dag.task("pick", "t.ok", branch=True)
    dag.task("left", "t.ok", upstream=["pick"])
    dag.task("right", "t.ok", upstream=["pick"])
    return dag


def mapped_body(n: int, failing: set[int]) -> Any:
    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        if key == "ls":
            return list(range(n))
        if key == "pick":
            return "left"
        if key.startswith("resize[") and int(key[7:-1]) in failing:
            raise Fail("boom")
        return 1

    return body


class TestMapsOnTheRunPage(WebCase):
    auth = TOKEN

    def setUp(self) -> None:
        super().setUp()
        self.session = {"Cookie": self.log_in(TOKEN)}

    def api(self, path: str) -> dict[str, Any]:
        r = self.get(path, **bearer(TOKEN))
        assert r.code == 200, (r.code, r.body[:300])
        return json.loads(r.body)  # type: ignore[no-any-return]

    def test_a_map_is_one_box_counting_its_children_and_expands(self) -> None:
        d = drive(self.orc, mapped_dag(), mapped_body(500, {3, 7}))
        states = d.states()
        assert sum(k.startswith("resize[") for k in states) == 500 and states["right"] == "SKIPPED"
        html = self.get(f"/runs/{d.run_id}").body.decode()
        # six boxes: ls, resize (one, whatever its width), join, pick, left, right
        assert html.count('class="node') == 6 and html.count('class="node map"') == 1
        assert 'data-key="resize[' not in html.split('<h3 id="tasks-title">')[0]  # no child drawn
        assert "resize \u00d7500 \u00b7 498 ok \u00b7 2 failed" in html  # the box's title
        assert 'data-total="500"' in html and "FAILED:2,SUCCEEDED:498" in html
        # the SKIPPED task says why, in its box and its row
        assert 'data-skip="branch_not_taken"' in html and "skipped: branch_not_taken" in html
        rows = re.findall(r'<tr id="task-([^"]+)" data-key="[^"]+" data-state="([^"]+)"', html)
        assert ("resize[0]", "SUCCEEDED") in rows  # the table lists the children
        html = self.get(f"/runs/{d.run_id}?q=" + quote("resize[3]")).body.decode()
        assert "item 3 of" in html
        html = self.get(f"/runs/{d.run_id}?q=resize").body.decode()
        assert "mapped into 500 task(s): 500 done (498 succeeded, 2 failed, 0 skipped)" in html
        # the map's box expanded: its children drawn, in map order
        part = self.get(f"/runs/{d.run_id}?part=map&key=resize")
        assert part.code == 200 and part.headers["Content-Type"].startswith("image/svg+xml")
        cells = re.findall(r'<g class="child" data-key="([^"]+)" data-state="([^"]+)"', part.body.decode())
        assert [k for k, _ in cells] == [f"resize[{i}]" for i in range(500)]
        assert [k for k, s in cells if s == "FAILED"] == ["resize[3]", "resize[7]"]
        assert self.get(f"/runs/{d.run_id}?part=map&key=join").code == 404  # not a map
        assert self.get(f"/runs/{d.run_id}?part=map&key=resize[3]").code == 404  # a child: not a map
        assert self.get(f"/runs/{d.run_id}?part=map&key=resize[x]").code == 400  # no node key
        assert self.get(f"/runs/{d.run_id}?part=map&key=resize", anonymous=True).code == 302
        # dot and mermaid say the same
        dot = self.get(f"/api/runs/{d.run_id}/graph?format=dot", **bearer(TOKEN)).body.decode()
        assert "resize \u00d7500" in dot and "skipped: branch_not_taken" in dot and "resize[" not in dot

    def test_the_drawing_of_a_wide_map_is_bounded(self) -> None:
        d = drive(self.orc, mapped_dag(), mapped_body(10_000, {5}), steps=3)
        # ls, pick and one more ran: the map expanded to 10,000 children
        run = d.run_id
        with self.orc.store.db.engine.begin() as conn:
            conn.execute(
                sa.text("UPDATE orc_tasks SET state = 'SUCCEEDED' WHERE run_id = :r AND map_parent = 'resize'"),
                {"r": run},
            )
            conn.execute(
                sa.text(
                    "UPDATE orc_tasks SET state = 'FAILED' WHERE run_id = :r AND key IN ('resize[5]', 'resize[9]')"
                ),
                {"r": run},
            )
        first = self.get(f"/runs/{run}")
        assert first.code == 200 and len(first.body) < 200_000
        svg = self.get(f"/runs/{run}?part=dag").body.decode()
        assert svg.count('class="node') == 6 and len(svg) < 20_000
        assert "resize \u00d710,000 \u00b7 9,998 ok \u00b7 2 failed" in svg
        part = self.get(f"/runs/{run}?part=map&key=resize").body.decode()
        assert part.count('class="child"') == 1000 and "1,000 of 10,000 shown" in part

    def test_child_keys_page_search_and_act_in_the_table(self) -> None:
        d = drive(self.orc, mapped_dag(), mapped_body(30, {3}))
        run = d.run_id
        # keyset paging walks children (keys with brackets) like any key
        seen: list[str] = []
        path: str | None = f"/runs/{run}?limit=7"
        while path:
            html = self.get(path).body.decode()
            seen += [unescape(k) for k in re.findall(r'<tr id="task-([^"]+)"', html)]
            nxt = re.search(r'id="tasks-next" href="([^"]+)"', html)
            path = unescape(nxt.group(1)) if nxt else None
        assert len(seen) == len(set(seen)) == len(d.states()) == 36
        assert self.get(f"/runs/{run}?after=" + quote("resize[3]")).code == 200
        assert self.get(f"/runs/{run}?after=" + quote("resize[3")).code == 400
        doc = self.api(f"/api/runs/{run}?q=" + quote("resize[1"))
        assert sorted(t["key"] for t in doc["tasks"]) == sorted(["resize[1]"] + [f"resize[{i}]" for i in range(10, 20)])
        one = next(t for t in doc["tasks"] if t["key"] == "resize[1]")
        assert one["map_parent"] == "resize" and one["map_index"] == 1 and one["map_key"] == "1"
        # the failed child's retry form posts to its URL-encoded key (a map without downstream: the
        # operator's retry of a child reopens it)
        run = drive(self.orc, mapped_dag("leaf", join=False), mapped_body(5, {3})).run_id
        html = self.get(f"/runs/{run}?q=" + quote("resize[3]")).body.decode()
        assert f'action="/runs/{run}/tasks/resize%5B3%5D/retry"' in html
        done = self.fetch(f"/api/runs/{run}/tasks/resize%5B3%5D/retry", method="POST", body="", headers=bearer(TOKEN))
        assert done.code == 200, done.body
        assert json.loads(done.body)["key"] == "resize[3]"
        assert self.orc.task(run, "resize[3]").state.value in ("READY", "QUEUED")
        assert self.orc.task(run, "resize").state.value == "MAPPED"  # the map reopened
        missing = self.fetch(
            f"/api/runs/{run}/tasks/resize%5B99%5D/retry", method="POST", body="", headers=bearer(TOKEN)
        )
        assert missing.code == 404

    def test_a_maps_children_are_cleared_and_marked_by_their_encoded_keys(self) -> None:
        d = drive(self.orc, mapped_dag(), mapped_body(5, {3}))
        run = d.run_id
        assert d.states()["resize"] == "FAILED"
        html = self.get(f"/runs/{run}?q=resize").body.decode()
        assert f'action="/runs/{run}/tasks/resize%5B3%5D/clear"' in html
        assert f'action="/runs/{run}/tasks/resize%5B3%5D/mark"' in html
        header = html.split('<tr id="task-resize"')[1].split("</tr>")[0]
        assert f'action="/runs/{run}/tasks/resize/clear"' in header and "/mark" not in header  # mark its children
        token, headers = self.xsrf()
        marked = self.post(f"/runs/{run}/tasks/resize%5B3%5D/mark", {"_xsrf": token, "state": "success"}, **headers)
        assert marked.code == 303, marked.body
        assert self.orc.task(run, "resize[3]").state.value == "SUCCEEDED"
        assert self.orc.task(run, "resize").state.value == "SUCCEEDED"  # the map counts it again and closes
        cleared = self.fetch(
            f"/api/runs/{run}/tasks/resize/clear?downstream=1", method="POST", body="", headers=bearer(TOKEN)
        )
        assert cleared.code == 200, cleared.body
        assert json.loads(cleared.body)["cleared"] == ["join", "resize"] + [f"resize[{i}]" for i in range(5)]
        assert self.orc.task(run, "resize").state.value == "MAPPED"

    def test_changes_repaint_a_maps_box_from_its_children(self) -> None:
        d = drive(self.orc, mapped_dag(), mapped_body(40, set()), until=lambda d: "resize[0]" in d.states())
        run = d.run_id
        self.get(f"/runs/{run}")  # the skeleton is kept
        last = self.api(f"/api/runs/{run}?limit=1&events=1")["page"]["last_event"]
        drive(
            self.orc,
            mapped_dag(),
            mapped_body(40, {2}),
            run_id=run,
            until=lambda d: d.states()["resize[5]"] != "QUEUED",
        )
        c = self.api(f"/api/runs/{run}/changes?after={last}")
        child = c["tasks"]["resize[2]"]
        assert child["state"] == "FAILED" and child["box"] is not None
        box = c["boxes"][child["box"]]
        assert box["key"] == "resize" and box["counts"]["FAILED"] == 1 and box["label"] == "resize \u00d740"
        assert box["sub"].startswith("3") or "ok" in box["sub"]
        assert box["title"].startswith("resize \u00d740 \u00b7 ")


def test_maps_and_skips_in_the_drawing_from_task_rows() -> None:
    infos = [
        drawing.TaskInfo("ls", "t", "SUCCEEDED"),
        drawing.TaskInfo("m", "t", "MAPPED", is_map=True),
        *[drawing.TaskInfo(f"m[{i}]", "t", "SUCCEEDED" if i % 10 else "FAILED", map_parent="m") for i in range(100)],
        drawing.TaskInfo("join", "t", "PENDING", "all_done"),
        drawing.TaskInfo("off", "t", "SKIPPED", skip_reason="short_circuit"),
        drawing.TaskInfo("empty", "t", "SKIPPED", skip_reason="empty_map", is_map=True),
    ]
    g = drawing.layout(infos, [("ls", "m"), ("m", "join"), ("ls", "off"), ("ls", "empty")])
    assert sorted(b.keys[0] for b in g.boxes) == ["empty", "join", "ls", "m", "off"]
    m = next(b for b in g.boxes if b.keys == ("m",))
    assert m.mapped and m.counts == {"FAILED": 10, "SUCCEEDED": 90} and not m.collapsed
    assert drawing.counted(m) == "m \u00d7100 \u00b7 90 ok \u00b7 10 failed"
    empty = next(b for b in g.boxes if b.keys == ("empty",))
    assert drawing.counted(empty) == "empty (map) \u00b7 skipped: empty_map"
    svg = drawing.to_svg(g)
    assert 'data-skip="short_circuit"' in svg and "skipped: short_circuit" in svg
    assert "m[" not in svg and svg.count('class="node') == 5
    mermaid = drawing.to_mermaid(g)
    assert "m \u00d7100<br/>90 ok \u00b7 10 failed" in mermaid and "classDef mapped" in mermaid
    # the same from task views: children counted in their map's box, edges or not
    views = [SimpleNamespace(**{**i.__dict__, "map_counts": None}, attempt_=1) for i in infos]
    again = drawing.from_views(views, [("ls", "m"), ("m", "join")])
    assert next(b for b in again.boxes if b.keys == ("m",)).counts == m.counts


class TestCanvasOnTheRunPage(WebCase):
    """A converted Celery canvas's keys (``ok[0]``, ``ok-2``, ``fail-ok``) on the page, its
    search, its drawing and the API."""

    auth = TOKEN

    def test_a_canvas_runs_keys_are_shown_found_and_drawn(self) -> None:
        from celery import Signature, chain, chord

        ok = Signature("t.ok")
        sig = chain(ok.clone(), chord([ok.clone(), ok.clone()], ok.clone())).on_error(Signature("t.fail"))
        run = self.orc.submit(DAG.from_canvas(sig, name="canvas"))
        finish(self.orc)
        self.session = {"Cookie": self.log_in(TOKEN)}
        html = self.get(f"/runs/{run.id}").body.decode()
        rows = dict(re.findall(r'<tr id="task-([^"]+)" data-key="[^"]+" data-state="([^"]+)"', html))
        assert rows == {
            "ok": "SUCCEEDED", "ok[0]": "SUCCEEDED", "ok[1]": "SUCCEEDED", "ok-2": "SUCCEEDED",
            "fail-ok": "SKIPPED", "fail-ok-2": "SKIPPED",
        }, rows  # fmt: skip
        found = self.get(f"/runs/{run.id}?q=" + quote("ok[1]")).body.decode()
        assert 'data-key="ok[1]"' in found
        assert self.get(f"/runs/{run.id}?part=dag").body.decode().count('class="node') == 6
        doc = json.loads(self.get(f"/api/runs/{run.id}", **bearer(TOKEN)).body)
        assert {t["key"] for t in doc["tasks"]} == set(rows)
