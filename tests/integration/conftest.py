"""A real Celery worker subprocess (prefork, embedded beat) on Postgres and Redis."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import Orchestrator
from tests.conftest import DATA_DIR, IT_DATABASE_URL, IT_DB, ensure_database, reset_schema

ROOT = Path(__file__).resolve().parents[2]


#: how much longer a loaded machine may take before a wait fails (CI: ORCHESTRATOR_TEST_WAIT_SCALE=6)
WAIT_SCALE = float(os.environ.get("ORCHESTRATOR_TEST_WAIT_SCALE", "1"))


def until(what: str, check: Callable[[], Any], timeout: float = 90.0, every: float = 0.05) -> Any:
    """Poll ``check`` until it returns something truthy (returned); fail the test after ``timeout``
    seconds times :data:`WAIT_SCALE` (the database decides, not the machine's speed: the timeout
    only bounds a hang)."""
    timeout *= WAIT_SCALE
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() >= deadline:
            pytest.fail(f"{what}: not after {timeout}s")
        time.sleep(every)


def sql(orc: Orchestrator, query: Any) -> list[Any]:
    """The rows of ``query`` on the orchestrator's database."""
    with orc.store.engine.connect() as conn:
        return list(conn.execute(query).all())


@dataclass
class WorkerProcess:
    proc: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def start_worker(log: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "config.celery_app",
        "worker",
        "--pool",
        "prefork",
        "--without-gossip",
        "--without-mingle",
        "--loglevel",
        "INFO",
        *extra,
    ]
    with log.open("ab") as out:
        return subprocess.Popen(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env or os.environ.copy(), start_new_session=True
        )


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """Warm-stop a process group we started; SIGKILL it if it does not stop in time."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def wait_until_ready(orc: Orchestrator, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"worker exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if orc.app.control.ping(timeout=0.5):
            return
    pytest.fail(f"worker not ready after {timeout}s:\n{log.read_text()[-3000:]}")


#: starts a worker of the test's own: ``(tag, queue, **env)`` -> ``(name, process)``
OwnWorker = Callable[..., tuple[str, subprocess.Popen[bytes]]]


@pytest.fixture
def own_worker(orc: Orchestrator) -> Iterator[OwnWorker]:
    """Starts a worker of the test's own (``-c 1 -Q queue``, ``env`` over this process's
    environment: ``ORCHESTRATOR_TASK_MODULES``, ``ORCHESTRATOR_CODE_VERSION``...) and waits until
    its registry row is written; returns its name and process. Every one is stopped afterwards
    (by its process group)."""
    from orchestrator.store.schema import workers as w

    started: list[subprocess.Popen[bytes]] = []

    def start(tag: str, queue: str, **env: str) -> tuple[str, subprocess.Popen[bytes]]:
        name = f"{tag}@{socket.gethostname()}"
        log = Path(DATA_DIR) / f"worker-{tag}.log"
        proc = start_worker(log, "-c", "1", "-Q", queue, "-n", name, env={**os.environ, **env})
        started.append(proc)
        until(
            f"worker {name} registered",
            lambda: proc.poll() is not None or sql(orc, sa.select(w.c.name).where(w.c.name == name)),
        )
        assert proc.poll() is None, log.read_text()[-3000:]
        return name, proc

    try:
        yield start
    finally:
        for proc in started:
            stop_process(proc)


@pytest.fixture(scope="session")
def orc(redis_client: object) -> Orchestrator:
    ensure_database(IT_DB)
    reset_schema(IT_DATABASE_URL)
    redis_client.flushdb()  # type: ignore[attr-defined]
    from orchestrator import default

    return default()


@pytest.fixture(scope="session")
def worker(orc: Orchestrator) -> Iterator[WorkerProcess]:
    log = Path(DATA_DIR) / "worker.log"
    proc = start_worker(log, "-c", "2", "-B", "-n", "it@%h", "-s", str(Path(DATA_DIR) / "beat-schedule"))
    try:
        wait_until_ready(orc, proc, log)
        yield WorkerProcess(proc, log)
    finally:
        stop_process(proc)


# ------------------------------------------------------------------ orchestrator serve and a browser

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(log: Path, env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``orchestrator serve`` on a free 127.0.0.1 port in its own process group, once it answers
    ``/healthz``: (the process, its base URL). Stopped by process group on the way out."""
    port = free_port()
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(base + "/healthz", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"orchestrator serve did not start:\n{log.read_text()}")
                time.sleep(0.2)
        yield proc, base
    finally:
        stop_process(proc)


@pytest.fixture
def browser() -> Iterator[object]:
    """Headless Chromium (Debian's chromium + chromium-driver) through Selenium; its console
    log is kept (CSP violations land there)."""
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.fail("the browser test needs Debian's chromium and chromium-driver (apt install chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@dataclass
class Server:
    base: str
    #: the login URL ``serve`` printed: http://127.0.0.1:PORT/login?token=TOKEN
    login: str


@pytest.fixture
def server(orc: Orchestrator, tmp_path: Path) -> Iterator[Server]:
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "ORCHESTRATOR_UI_AUTH"}
    with serving(log, env) as (proc, base):
        deadline = time.monotonic() + 30
        while not (found := re.search(rf"{re.escape(base)}/login\?token=[A-Za-z0-9_-]+", log.read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"orchestrator serve printed no login URL:\n{log.read_text()}")
            time.sleep(0.1)
        yield Server(base, found.group(0))
