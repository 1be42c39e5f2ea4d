"""Tags and bulk actions in ``orchestrator serve`` (issue 34), over HTTP on the Postgres test
database: the runs list's tag filter and tags (page and JSON), the run's document with its tags,
``POST /api/bulk/ACTION`` (dry run, then the action; refusals that write nothing), the runs list's
bulk form (XSRF, a preview, then the action), and a tenant-bound credential that selects and acts
on its tenant's runs only."""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import urlencode

from tests.unit.test_web import ACME_TOKEN, TENANTS_AUTH, WebCase, bearer, diamond, finish


class TagsCase(WebCase):
    def tagged(self, customer: str, *, fail: bool = True, tenant: str | None = None) -> str:
        run = self.orc.submit(diamond(), tags={"customer": customer, "region": "eu"}, tenant=tenant)
        finish(self.orc, fail={"b"} if fail else set())
        return run.id

    def ledger(self) -> int:
        return sum(len(self.orc.ledger(v.id)) for v in self.orc.runs(1000))

    def api(self, path: str, form: dict[str, Any] | None = None) -> tuple[int, Any]:
        token, headers = self.xsrf()
        fields = [(k, v) for k, vs in (form or {}).items() for v in (vs if isinstance(vs, list) else [vs])]
        body = [("_xsrf", token), *fields]
        answer = self.fetch(
            path, method="POST", body=urlencode(body), headers=self._headers(headers, False), follow_redirects=False
        )
        return answer.code, json.loads(answer.body) if answer.body.startswith(b"{") else answer.body


class TestTagsLocal(TagsCase):
    def setUp(self) -> None:
        super().setUp()
        self.session = {"Cookie": self.log_in(self.generated)}

    def test_the_runs_list_filters_by_tags_and_shows_them(self) -> None:
        a, b = self.tagged("42"), self.tagged("7", fail=False)
        runs = json.loads(self.get("/api/runs?tag=customer%3D42").body)["runs"]
        assert [r["id"] for r in runs] == [a] and runs[0]["tags"] == {"customer": "42", "region": "eu"}
        both = json.loads(self.get("/api/runs?tag=customer%3D42&tag=region%3Deu&state=FAILED&dag=diamond").body)
        assert [r["id"] for r in both["runs"]] == [a]
        assert json.loads(self.get("/api/runs?tag=customer%3D42&state=SUCCEEDED").body)["runs"] == []
        assert {r["id"] for r in json.loads(self.get("/api/runs?tag=region%3Deu").body)["runs"]} == {a, b}
        bad = self.get("/api/runs?tag=customer")
        assert bad.code == 400 and "tag takes KEY=VALUE" in json.loads(bad.body)["error"]
        # the run's document and page carry its tags
        assert json.loads(self.get(f"/api/runs/{a}").body)["run"]["tags"] == {"customer": "42", "region": "eu"}
        assert b'id="run-tags"' in self.get(f"/runs/{a}").body
        # the page: its filter, the tags column, links that keep the filter, and the bulk form
        page = self.get("/runs?tag=customer%3D42&state=FAILED").body.decode()
        assert a in page and b not in page
        assert 'name="tag" value="customer=42"' in page and "customer=42" in page
        assert 'id="bulk-retry" formaction="/bulk/retry"' in page
        assert 'id="bulk"' not in self.get("/runs").body.decode()  # no filter: no bulk form

    def test_api_bulk_retry_dry_run_then_apply(self) -> None:
        failed = [self.tagged("42") for _ in range(2)]
        ok = self.tagged("42", fail=False)
        other = self.tagged("7")
        before = self.ledger()
        code, plan = self.api("/api/bulk/retry", {"tag": "customer=42", "dry_run": "1"})
        assert code == 200, plan
        assert plan["dry_run"] is True and (plan["matched"], plan["changed"], plan["skipped"]) == (3, 2, 1)
        assert {r["run"]: r["outcome"] for r in plan["runs"]} == {failed[0]: "planned", failed[1]: "planned",
                                                                  ok: "skipped"}  # fmt: skip
        assert self.ledger() == before
        code, done = self.api("/api/bulk/retry", {"tag": ["customer=42", "region=eu"], "state": "FAILED"})
        assert code == 200 and done["ok"] is True and done["changed"] == 2, done
        assert done["filter"] == {"tags": {"customer": "42", "region": "eu"}, "state": "FAILED", "dag": None,
                                  "tenant": None}  # fmt: skip
        for run_id in failed:
            assert self.orc.run_state(run_id).value == "RUNNING"
            assert {e.by for e in self.orc.ledger(run_id) if e.actor == "operator"} == {"token (web from 127.0.0.1)"}
        assert self.orc.run_state(other).value == "FAILED"

    def test_api_bulk_refusals_write_nothing(self) -> None:
        self.tagged("42")
        before = self.ledger()
        for form, status, named in (
            ({}, 400, "a bulk action needs a filter"),
            ({"tag": "customer"}, 400, "tag takes KEY=VALUE"),
            ({"state": "nope"}, 400, "unknown run state 'nope'"),
            ({"tag": "customer=42", "dry_run": "maybe"}, 400, "dry_run must be 1 or 0"),
        ):
            code, answer = self.api("/api/bulk/cancel", form)
            assert code == status and named in answer["error"], (form, code, answer)
        assert self.post("/api/bulk/cancel", {"tag": "customer=42"}).code == 403  # no XSRF token
        assert self.api("/api/bulk/purge", {"tag": "customer=42"})[0] == 404
        assert self.ledger() == before

    def test_the_runs_lists_bulk_form_previews_then_acts(self) -> None:
        run_id = self.tagged("42")
        token, headers = self.xsrf()
        preview = self.post("/bulk/retry", {"_xsrf": token, "tag": "customer=42", "state": "FAILED", "dry_run": "1"},
                            **headers)  # fmt: skip
        assert preview.code == 200, preview.body[:300]
        html = preview.body.decode()
        assert "bulk retry (dry run: nothing written): 1 run(s) would retry" in html
        assert f'data-run="{run_id}" data-outcome="planned"' in html
        assert 'id="bulk-apply" method="post" action="/bulk/retry"' in html
        assert 'name="tag" value="customer=42"' in html and 'name="state" value="FAILED"' in html
        assert 'href="/runs?state=FAILED&amp;tag=customer%3D42"' in html
        assert self.orc.run_state(run_id).value == "FAILED"
        applied = self.post("/bulk/retry", {"_xsrf": token, "tag": "customer=42", "state": "FAILED"}, **headers)
        assert applied.code == 200 and f'data-run="{run_id}" data-outcome="done"' in applied.body.decode()
        assert re.search(r"bulk retry: 1 run\(s\) retried, 0 skipped, 0 failed", applied.body.decode())
        assert self.orc.run_state(run_id).value == "RUNNING"


class TestTagsTenantBound(TagsCase):
    auth = TENANTS_AUTH
    bind = "0.0.0.0"

    def test_a_tenant_bound_credential_sees_and_acts_on_its_tenants_runs_only(self) -> None:
        mine, theirs = self.tagged("42", tenant="acme"), self.tagged("42", tenant="bravo")
        self.session = bearer(ACME_TOKEN)
        assert [r["id"] for r in json.loads(self.get("/api/runs?tag=customer%3D42").body)["runs"]] == [mine]
        assert json.loads(self.get("/api/runs?tag=customer%3D42&tenant=bravo").body)["runs"] == []
        code, plan = self.api("/api/bulk/retry", {"tag": "customer=42", "dry_run": "1"})
        assert code == 200 and [r["run"] for r in plan["runs"]] == [mine]
        code, other = self.api("/api/bulk/retry", {"tag": "customer=42", "tenant": "bravo"})
        assert code == 200 and other["matched"] == 0
        code, done = self.api("/api/bulk/cancel", {"tag": "customer=42", "state": "FAILED"})
        assert code == 200 and done["matched"] == 1 and done["runs"][0]["run"] == mine
        code, done = self.api("/api/bulk/retry", {"tag": "customer=42"})
        assert code == 200 and [(r["run"], r["outcome"]) for r in done["runs"]] == [(mine, "done")]
        assert self.orc.run_state(mine).value == "RUNNING"
        assert self.orc.run_state(theirs).value == "FAILED"
        assert not [e for e in self.orc.ledger(theirs) if e.actor == "operator"]
