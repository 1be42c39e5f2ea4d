"""A private PostgreSQL server for outage tests: its own data directory on a free port, so a
test may stop and restart it without touching the shared server other suites use.

Runs the Debian cluster binaries (``/usr/lib/postgresql/<version>/bin``); as root it runs
them as the ``postgres`` user (the server refuses to run as root). Missing binaries fail the
test: the outage tests are part of the suite, never skipped.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.fault.harness import free_port


def _bindir() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    if not found:
        found_path = shutil.which("pg_ctl")
        if found_path is None:
            pytest.fail("no pg_ctl: the outage tests need the PostgreSQL server binaries")
        return Path(found_path).parent
    return found[-1].parent


class PrivatePostgres:
    def __init__(self) -> None:
        self.bin = _bindir()
        # not under pytest's tmp_path: the postgres user must be able to reach it
        self.root = Path(tempfile.mkdtemp(prefix="orc-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self._user: list[str] = []
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            self._user = ["runuser", "-u", "postgres", "--"]
        os.chmod(self.root, 0o755)

    def _run(self, *cmd: str, timeout: float = 60.0) -> None:
        done = subprocess.run([*self._user, *cmd], capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stdout}{done.stderr}{self.tail()}")

    def tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-3000:]
        return ""

    def init(self) -> None:
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def restart(self, down_for: float) -> None:
        """Stop (terminating every session), stay down ``down_for`` seconds, start again."""
        self.stop("fast")
        time.sleep(down_for)
        self.start()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)
