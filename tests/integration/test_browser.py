"""The run page in a real browser: headless Chromium (Debian's chromium + chromium-driver)
driven by Selenium against a real ``orchestrator serve`` process, a real worker and Postgres.

``serve`` runs without ``ORCHESTRATOR_UI_AUTH`` on loopback, so it makes a token at start and
prints its login URL: the browser logs in through that URL (and is refused without it). The
run-page test parks a task in DEAD_LETTER, checks that the page draws every node with its state
from the database, clicks *retry* on the parked task, and follows the run to SUCCEEDED; the
page's script runs under the Content-Security-Policy (no violation in the console). Another
clears a FAILED task with its downstream, reruns the run (landing on the new one) and marks a
failed task there success, each through the page's forms and their confirmations. A task group
is one box that a click opens, its counts kept current by the polls. Its
screenshot goes to the test's temporary directory; with ``ORCHESTRATOR_DOCS_SCREENSHOT=PATH``
it is also copied there (how ``docs/run-page.png`` in the README was made).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator import DAG, Orchestrator
from orchestrator.core.states import RunState, TaskState
from tests.integration.conftest import Server, WorkerProcess

P = "tasks.probes."

pytestmark = pytest.mark.timeout(240)


def wait_for(what: str, check: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def drawn(driver: object) -> dict[str, str]:
    from selenium.webdriver.common.by import By

    nodes = driver.find_elements(By.CSS_SELECTOR, "#dag svg g.node")  # type: ignore[attr-defined]
    return {n.get_attribute("data-key"): n.get_attribute("data-state") for n in nodes}


def csp_violations(driver: object) -> list[str]:
    logs = driver.get_log("browser")  # type: ignore[attr-defined]
    return [e["message"] for e in logs if "Content Security Policy" in e["message"]]


def test_token_login(orc: Orchestrator, server: Server, browser: object) -> None:
    """Without the token: the login form; through the printed URL: the runs page."""
    from selenium.webdriver.common.by import By

    dag = DAG("login_probe")
    dag.task("a", P + "echo")
    run = orc.submit(dag)  # no worker: it waits, a run to list
    driver = browser
    driver.get(f"{server.base}/runs")  # type: ignore[attr-defined]
    assert "/login" in driver.current_url and run.id not in driver.page_source  # type: ignore[attr-defined]
    assert driver.find_elements(By.CSS_SELECTOR, 'form[action="/login"] input[name="token"]')  # type: ignore[attr-defined]
    driver.get(f"{server.base}/api/runs/{run.id}")  # type: ignore[attr-defined]
    assert run.id not in driver.page_source  # type: ignore[attr-defined]
    driver.get(server.login.replace("token=", "token=wrong"))  # type: ignore[attr-defined]
    assert "403" in driver.page_source and run.id not in driver.page_source  # type: ignore[attr-defined]
    assert not driver.get_cookies() or all(c["name"] != "orc_user" for c in driver.get_cookies())  # type: ignore[attr-defined]
    driver.get(server.login)  # type: ignore[attr-defined]
    assert driver.current_url == f"{server.base}/runs"  # type: ignore[attr-defined]
    assert run.id in driver.page_source  # type: ignore[attr-defined]
    # the token left the address bar; the session is an HttpOnly cookie
    session = [c for c in driver.get_cookies() if c["name"] == "orc_user"]  # type: ignore[attr-defined]
    assert len(session) == 1 and session[0]["httpOnly"] is True
    # the login form works too (a new browser session: the cookie gone)
    driver.delete_all_cookies()  # type: ignore[attr-defined]
    driver.get(f"{server.base}/runs/{run.id}")  # type: ignore[attr-defined]
    assert "/login" in driver.current_url  # type: ignore[attr-defined]
    driver.find_element(By.NAME, "token").send_keys(server.login.split("token=", 1)[1])  # type: ignore[attr-defined]
    driver.find_element(By.CSS_SELECTOR, 'form[action="/login"] button').click()  # type: ignore[attr-defined]
    wait_for("the run page", lambda: driver.current_url == f"{server.base}/runs/{run.id}", 10)  # type: ignore[attr-defined]
    assert csp_violations(driver) == []


def test_run_page_draws_the_dag_and_retries_a_parked_task(
    orc: Orchestrator, worker: WorkerProcess, server: Server, browser: object, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    dag = DAG("nightly_revenue")
    extract = dag.task("extract", P + "echo", kwargs={"rows": 3})
    audit = dag.task("audit", P + "echo", upstream=[extract])
    transform = dag.task("transform", P + "poisoned", kwargs={"until_attempt": 3}, upstream=[extract], max_attempts=3)
    dag.task("load", P + "echo", upstream=[transform, audit])
    dag.task("notify", P + "echo", upstream=[transform], trigger_rule="all_done")
    run = orc.submit(dag)
    wait_for("transform parked", lambda: run.task("transform").state is TaskState.DEAD_LETTER)

    driver = browser
    driver.get(server.login)  # type: ignore[attr-defined]
    driver.get(f"{server.base}/runs/{run.id}")  # type: ignore[attr-defined]
    states = {t.key: t.state.value for t in run.tasks()}
    assert drawn(driver) == states, (drawn(driver), states)
    assert states["transform"] == "DEAD_LETTER" and states["load"] == "PENDING"
    # the box's fill is the state's colour; the all_done rule is written in its box
    from orchestrator.core.graph import COLOURS

    box = driver.find_element(By.CSS_SELECTOR, '#dag g.node[data-key="transform"] rect')  # type: ignore[attr-defined]
    assert box.get_attribute("fill") == COLOURS["DEAD_LETTER"]
    notify = driver.find_element(By.CSS_SELECTOR, '#dag g.node[data-key="notify"]')  # type: ignore[attr-defined]
    assert notify.get_attribute("data-rule") == "all_done" and "all_done" in notify.text
    assert len(driver.find_elements(By.CSS_SELECTOR, "#dag svg path.edge")) == 5  # type: ignore[attr-defined]
    # a waiting task says why it waits
    why = driver.find_element(By.CSS_SELECTOR, "#task-load .wait").text  # type: ignore[attr-defined]
    assert "transform" in why, why

    # the page's script runs under the CSP (its nonce): "fit" and "+" resize the drawing
    svg = driver.find_element(By.CSS_SELECTOR, "#dag svg")  # type: ignore[attr-defined]
    before = svg.get_attribute("width")
    driver.find_element(By.CSS_SELECTOR, 'button[data-zoom="1.25"]').click()  # type: ignore[attr-defined]
    assert svg.get_attribute("width") != before
    driver.find_element(By.CSS_SELECTOR, 'button[data-zoom="0"]').click()  # type: ignore[attr-defined]
    assert csp_violations(driver) == []

    shot = tmp_path / "run-page.png"
    assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000  # type: ignore[attr-defined]
    if os.environ.get("ORCHESTRATOR_DOCS_SCREENSHOT"):
        shutil.copy(shot, os.environ["ORCHESTRATOR_DOCS_SCREENSHOT"])

    driver.find_element(By.CSS_SELECTOR, '#task-transform button[data-action="retry"]').click()  # type: ignore[attr-defined]
    # the POST answers with the run page again: wait for it (a loaded machine takes a while)
    wait_for("the action's banner", lambda: driver.find_elements(By.CSS_SELECTOR, ".banner"), timeout=30)  # type: ignore[attr-defined]
    banner = driver.find_element(By.CSS_SELECTOR, ".banner.ok").text  # type: ignore[attr-defined]
    assert "transform: retry done" in banner
    assert run.wait(timeout=60).state is RunState.SUCCEEDED
    retried = [e for e in run.events() if e.key == "transform" and e.actor == "operator"]
    assert len(retried) == 1 and retried[0].to_state == "READY"
    assert retried[0].by == "token (web from 127.0.0.1)"

    driver.get(f"{server.base}/runs/{run.id}")  # type: ignore[attr-defined]
    assert drawn(driver) == dict.fromkeys(states, "SUCCEEDED")
    assert driver.find_element(By.ID, "run-state").text == "SUCCEEDED"  # type: ignore[attr-defined]
    # a final run offers no retry, skip, fail or cancel: a clear or a mark of each task, and a rerun
    offered = {b.get_attribute("data-action") for b in driver.find_elements(By.CSS_SELECTOR, "button.action")}  # type: ignore[attr-defined]
    assert offered == {"clear", "mark"} and not driver.find_elements(By.ID, "cancel-run")  # type: ignore[attr-defined]
    assert len(driver.find_elements(By.CSS_SELECTOR, 'button[data-action="clear"]')) == len(states)  # type: ignore[attr-defined]
    assert driver.find_elements(By.ID, "rerun-run")  # type: ignore[attr-defined]
    driver.save_screenshot(str(tmp_path / "run-page-final.png"))  # type: ignore[attr-defined]


def test_a_map_is_one_box_that_expands_and_a_skip_says_why(
    orc: Orchestrator, worker: WorkerProcess, server: Server, browser: object
) -> None:
    """A map of 40 children is drawn as one box counting them; a click draws its children; a
    branch's skipped task says why in its box."""
    from selenium.webdriver.common.by import By

    dag = DAG("mapped_page")
    dag.map("resize", P + "echo", over=list(range(40)), kwarg="x")
    dag.task("join", P + "echo", upstream=["resize"])
    dag.task("check", P + "noop", short_circuit=True)  # returns None: what follows is skipped
    dag.task("after", P + "echo", upstream=["check"])
    run = orc.submit(dag)
    assert run.wait(timeout=90).state is RunState.SUCCEEDED

    driver = browser
    driver.get(server.login)  # type: ignore[attr-defined]
    driver.get(f"{server.base}/runs/{run.id}")  # type: ignore[attr-defined]
    wait_for("the page's script", lambda: driver.find_element(By.ID, "run").get_attribute("data-ready") == "1", 10)  # type: ignore[attr-defined]
    boxes = drawn(driver)
    assert set(boxes) == {"resize", "join", "check", "after"}, boxes  # no box per child
    after = driver.find_element(By.CSS_SELECTOR, '#dag g.node[data-key="after"]')  # type: ignore[attr-defined]
    assert after.get_attribute("data-skip") == "short_circuit" and "skipped: short_circuit" in after.text
    box = driver.find_element(By.CSS_SELECTOR, '#dag g.node.map[data-key="resize"]')  # type: ignore[attr-defined]
    assert box.get_attribute("data-total") == "40" and "resize \u00d740" in box.text and "40 ok" in box.text
    box.find_element(By.CSS_SELECTOR, "rect").click()
    wait_for(
        "the map's children drawn",
        lambda: len(driver.find_elements(By.CSS_SELECTOR, "#map-view g.child")) == 40,  # type: ignore[attr-defined]
        10,
    )
    cells = driver.find_elements(By.CSS_SELECTOR, "#map-view g.child")  # type: ignore[attr-defined]
    assert [c.get_attribute("data-key") for c in cells] == [f"resize[{i}]" for i in range(40)]
    assert {c.get_attribute("data-state") for c in cells} == {"SUCCEEDED"}
    assert csp_violations(driver) == []


def confirm(driver: object) -> None:
    """Accept the page's confirm() (a clear, a mark, a rerun ask first)."""
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, 10).until(expected_conditions.alert_is_present())  # type: ignore[arg-type]
    driver.switch_to.alert.accept()  # type: ignore[attr-defined]


def banner_of(driver: object) -> str:
    from selenium.webdriver.common.by import By

    wait_for("the action's banner", lambda: driver.find_elements(By.CSS_SELECTOR, ".banner"), timeout=30)  # type: ignore[attr-defined]
    return str(driver.find_element(By.CSS_SELECTOR, ".banner").text)  # type: ignore[attr-defined]


def test_clear_rerun_and_mark_from_the_run_page(
    orc: Orchestrator, worker: WorkerProcess, server: Server, browser: object
) -> None:
    """A FAILED task cleared with its downstream runs again to SUCCEEDED; Rerun makes a linked
    run and the browser lands on it; there a failed task marked success lets its children run."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    dag = DAG("clear_page")
    extract = dag.task("extract", P + "echo")
    transform = dag.task("transform", P + "flaky", kwargs={"fail_times": 1}, upstream=[extract])
    load = dag.task("load", P + "echo", upstream=[transform])
    dag.task("report", P + "echo", upstream=[load], trigger_rule="all_done")
    run = orc.submit(dag)
    assert run.wait(timeout=90).state is RunState.FAILED
    assert run.task("transform").state is TaskState.FAILED and run.task("load").state is TaskState.UPSTREAM_FAILED

    driver = browser
    driver.get(server.login)  # type: ignore[attr-defined]
    driver.get(f"{server.base}/runs/{run.id}")  # type: ignore[attr-defined]
    row = driver.find_element(By.ID, "task-transform")  # type: ignore[attr-defined]
    assert row.find_element(By.NAME, "downstream").is_selected()  # downstream by default
    row.find_element(By.CSS_SELECTOR, 'button[data-action="clear"]').click()
    confirm(driver)
    assert "transform: cleared with its downstream, 3 task(s)" in banner_of(driver)
    assert run.wait(timeout=60).state is RunState.SUCCEEDED
    assert run.task("transform").attempt == 2 and run.task("report").attempt == 2
    cleared = [e for e in run.events() if e.actor == "operator" and e.key is not None]
    assert {e.key for e in cleared} == {"transform", "load", "report"}
    assert {e.by for e in cleared} == {"token (web from 127.0.0.1)"}

    driver.get(f"{server.base}/runs/{run.id}")  # type: ignore[attr-defined]
    driver.find_element(By.ID, "rerun-run").click()  # type: ignore[attr-defined]
    confirm(driver)
    assert "a rerun of " + run.id in banner_of(driver)
    new_id = driver.find_element(By.ID, "run").get_attribute("data-run")  # type: ignore[attr-defined]
    assert new_id != run.id and driver.current_url == f"{server.base}/runs/{new_id}"  # type: ignore[attr-defined]
    assert driver.find_element(By.ID, "rerun-of").get_attribute("href") == f"{server.base}/runs/{run.id}"  # type: ignore[attr-defined]
    again = orc.run(new_id)
    assert again.wait(timeout=60).state is RunState.FAILED  # the same snapshot: transform fails once more

    driver.get(f"{server.base}/runs/{new_id}")  # type: ignore[attr-defined]
    row = driver.find_element(By.ID, "task-transform")  # type: ignore[attr-defined]
    Select(row.find_element(By.NAME, "state")).select_by_value("success")
    row.find_element(By.CSS_SELECTOR, 'button[data-action="mark"]').click()
    confirm(driver)
    assert "transform: marked SUCCEEDED (was FAILED)" in banner_of(driver)
    assert again.wait(timeout=60).state is RunState.SUCCEEDED
    assert again.task("transform").attempt == 1 and again.task("load").state is TaskState.SUCCEEDED
    assert csp_violations(driver) == []


def test_approve_a_waiting_task_from_the_run_page(
    orc: Orchestrator, worker: WorkerProcess, server: Server, browser: object
) -> None:
    """An approval node WAITING is drawn as such and offers Approve / Reject; Approve (after its
    confirmation) lets the run go on to SUCCEEDED, recorded with who approved."""
    from selenium.webdriver.common.by import By

    dag = DAG("approve_page")
    dag.approval("sign-off")
    dag.task("ship", P + "echo", upstream=["sign-off"])
    run = orc.submit(dag)
    wait_for("the approval to wait", lambda: run.task("sign-off").state is TaskState.WAITING, timeout=30)

    driver = browser
    driver.get(server.login)  # type: ignore[attr-defined]
    driver.get(f"{server.base}/runs/{run.id}")  # type: ignore[attr-defined]
    wait_for("the drawing", lambda: drawn(driver).get("sign-off") == "WAITING", timeout=30)
    row = driver.find_element(By.ID, "task-sign-off")  # type: ignore[attr-defined]
    assert row.get_attribute("data-state") == "WAITING"
    assert row.find_elements(By.CSS_SELECTOR, 'button[data-action="reject"]')
    row.find_element(By.CSS_SELECTOR, 'button[data-action="approve"]').click()
    confirm(driver)
    assert "sign-off: approved" in banner_of(driver)
    assert run.wait(timeout=60).state is RunState.SUCCEEDED
    answer = run.task("sign-off").result
    assert answer["approved"] is True and answer["by"] == "token (web from 127.0.0.1)"
    assert csp_violations(driver) == []


def test_a_task_group_is_one_box_that_opens_and_follows_the_run(
    orc: Orchestrator, worker: WorkerProcess, server: Server, browser: object
) -> None:
    """Each task group is one box counting its tasks (Airflow's collapsed group), an edge's label
    is on its arrow; a click on a group's box draws its tasks (its inner group folded), the polls
    keep the open drawing's boxes current (an approval inside a folded group answered: its box
    counts it), and *fold groups* folds them again."""
    from selenium.webdriver.common.by import By

    dag = DAG("grouped_page")
    start = dag.task("start", P + "echo")
    with dag.group("section_1", upstream=[start]) as section_1:
        dag.approval("sign_off")
        dag.task("load", P + "echo", upstream=["sign_off"])
    with dag.group("section_2", upstream=[section_1]) as section_2:
        dag.task("a", P + "echo")
        with dag.group("inner"):
            dag.task("b", P + "echo")
    dag.task("end", P + "echo", upstream=[section_2])
    dag.label(start, section_1, "go")
    run = orc.submit(dag)
    wait_for("the approval to wait", lambda: run.task("section_1.sign_off").state is TaskState.WAITING, timeout=30)

    driver = browser
    driver.get(server.login)  # type: ignore[attr-defined]
    driver.get(f"{server.base}/runs/{run.id}")  # type: ignore[attr-defined]
    wait_for("the page's script", lambda: driver.find_element(By.ID, "run").get_attribute("data-ready") == "1", 10)  # type: ignore[attr-defined]

    def group_box(name: str) -> Any:
        return driver.find_element(By.CSS_SELECTOR, f'#dag g.node.group[data-group="{name}"]')  # type: ignore[attr-defined]

    def fresh(check: Any) -> Any:
        """``check`` made false while the drawing is being replaced (a click redraws it)."""
        from selenium.common.exceptions import StaleElementReferenceException

        def checked() -> bool:
            try:
                return bool(check())
            except StaleElementReferenceException:
                return False

        return checked

    def groups() -> set[str]:
        found = driver.find_elements(By.CSS_SELECTOR, "#dag g.node.group")  # type: ignore[attr-defined]
        return {g.get_attribute("data-group") for g in found}

    assert groups() == {"section_1", "section_2"} and set(drawn(driver)) == {"start", "end", None}
    assert "WAITING:1" in group_box("section_1").get_attribute("data-counts")
    labels = driver.find_elements(By.CSS_SELECTOR, "#dag text.elabel")  # type: ignore[attr-defined]
    assert [t.text for t in labels] == ["go"]
    group_box("section_2").find_element(By.CSS_SELECTOR, "rect").click()
    wait_for("section_2 drawn task by task", fresh(lambda: "section_2.a" in drawn(driver)), 10)
    assert groups() == {"section_1", "section_2.inner"}
    assert driver.find_element(By.ID, "fold-groups").is_displayed()  # type: ignore[attr-defined]
    orc.approve(run.id, "section_1.sign_off")
    assert run.wait(timeout=60).state is RunState.SUCCEEDED
    wait_for(
        "the open drawing kept current",
        fresh(
            lambda: (
                group_box("section_1").get_attribute("data-counts") == "SUCCEEDED:2"
                and drawn(driver).get("section_2.a") == "SUCCEEDED"
                and group_box("section_2.inner").get_attribute("data-counts") == "SUCCEEDED:1"
            )
        ),
        30,
    )
    driver.find_element(By.ID, "fold-groups").click()  # type: ignore[attr-defined]
    wait_for("the groups folded again", fresh(lambda: groups() == {"section_1", "section_2"}), 10)
    assert csp_violations(driver) == []
