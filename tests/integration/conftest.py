"""A real Celery worker subprocess (prefork, embedded beat) on Postgres and Redis."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator import Orchestrator
from tests.conftest import DATA_DIR, IT_DATABASE_URL, IT_DB, ensure_database, reset_schema

ROOT = Path(__file__).resolve().parents[2]


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
