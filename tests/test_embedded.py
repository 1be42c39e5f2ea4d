"""The embedded PostgreSQL shared by several processes: two CLI processes started at once on
an empty data directory start one server between them and both migrate-or-attach; it outlives
them, and `orchestrator embedded stop` stops it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.core.config import Settings
from orchestrator.store import embedded
from tests.conftest import stop_embedded

ROOT = Path(__file__).resolve().parents[1]
SPEC = """
name: hello
nodes:
  - key: only
    task: tasks.probes.noop
"""


def cli(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_two_processes_share_one_embedded_server(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
    env["ORCHESTRATOR_DATA_DIR"] = str(tmp_path / "data")
    spec = tmp_path / "hello.yaml"
    spec.write_text(SPEC)
    pgdata = tmp_path / "data" / "pg"
    try:
        # two processes at once on an empty directory: one initialises and starts the server,
        # the other waits for it; both migrate (one after the other) and submit
        procs = [cli(env, "submit", str(spec)), cli(env, "submit", str(spec))]
        outs = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        st = embedded.status(pgdata)
        assert st.running and st.pid is not None
        # both processes have exited: the server outlives them, and a third process attaches
        listed = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "runs", "--json"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert listed.returncode == 0, listed.stderr
        assert len(json.loads(listed.stdout)["runs"]) == 2
        assert embedded.status(pgdata).pid == st.pid  # the same server, not a second one
        status = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "embedded", "status"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 0 and f"pid {st.pid}" in status.stdout
        stopped = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "embedded", "stop"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stderr
        assert not embedded.status(pgdata).running
        status = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "embedded", "status"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 3 and "not running" in status.stdout
        # started again on the same data directory: the runs are still there
        again = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "runs", "--json"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert again.returncode == 0 and len(json.loads(again.stdout)["runs"]) == 2
    finally:
        stop_embedded(tmp_path / "data")


def test_the_embedded_server_runs_postgres_18_and_the_production_functions(tmp_path: Path) -> None:
    import sqlalchemy as sa

    from orchestrator.store import make_engine, migrate

    url = Settings.from_env({}, data_dir=str(tmp_path)).database_url
    assert url == f"embedded://{tmp_path}/pg"
    try:
        engine = make_engine(url)
        migrate.upgrade(engine)
        with engine.connect() as conn:
            assert conn.execute(sa.text("SHOW server_version_num")).scalar_one().startswith("18")
            assert conn.execute(sa.text("SELECT to_regproc('orc_succeed_v1')")).scalar_one() is not None
        engine.dispose()
    finally:
        stop_embedded(tmp_path)


@pytest.mark.parametrize("url", ["sqlite:///x.db", "mysql://h/db", "embedded://relative/path"])
def test_a_database_url_that_is_not_postgres_is_refused(url: str) -> None:
    from orchestrator.core.errors import ConfigurationError
    from orchestrator.store import make_engine

    with pytest.raises(ConfigurationError, match=r"Postgres|embedded"):
        make_engine(url)


def test_a_stale_pid_file_naming_another_process_does_not_block_the_server(tmp_path: Path) -> None:
    """After a crash or a reboot, postmaster.pid may name a pid now used by another process:
    that process is not taken for the server, the stale file goes, the server starts."""
    pgdata = tmp_path / "data+x@y" / "pg"  # '+' and '@' must survive the URL too
    try:
        embedded.ensure(pgdata)
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
        assert embedded.stop(pgdata)
        lines[0] = str(os.getpid())  # a live process that is not this directory's server
        (pgdata / "postmaster.pid").write_text("\n".join(lines) + "\n")
        assert not embedded.status(pgdata).running
        url = embedded.ensure(pgdata)
        st = embedded.status(pgdata)
        assert st.running and st.pid != os.getpid()
        import sqlalchemy as sa

        engine = sa.create_engine(url)
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT current_database()")).scalar_one() == "orchestrator"
        engine.dispose()
    finally:
        embedded.stop(pgdata)


def test_a_data_directory_the_shell_would_split_is_refused(tmp_path: Path) -> None:
    from orchestrator.core.errors import ConfigurationError

    for name in ("with space", "e$(id)", "a&b"):
        with pytest.raises(ConfigurationError, match="ORCHESTRATOR_DATA_DIR"):
            embedded.ensure(tmp_path / name / "pg")
        assert not (tmp_path / name).exists()
