"""Static checks of docker-compose.yml and the Dockerfile (no Docker engine needed).

Every ``orchestrator ...`` command in the compose file must parse against the real click
group, and every ``celery -A <module>`` must name an importable module with an ``app``.
Recovery must not depend on beat: the workers run the reconciler (unless the compose file
turns that off, in which case an ``orchestrator reconcile`` service must exist).
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
import sqlalchemy as sa
import yaml

from orchestrator.cli import main
from orchestrator.core.config import Settings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"

DIRECT_URL = "postgresql+psycopg://orchestrator:orchestrator@postgres:5432/orchestrator"
EXPECTED_ENV = {
    "ORCHESTRATOR_DATABASE_URL": "postgresql+psycopg://orchestrator:orchestrator@pgbouncer:5432/orchestrator",
    "ORCHESTRATOR_DB_TRANSACTION_POOLER": "true",
    "ORCHESTRATOR_DB_DIRECT_URL": DIRECT_URL,
    "ORCHESTRATOR_BROKER_URL": "redis://redis:6379/0",
    "ORCHESTRATOR_DATA_DIR": "/var/lib/orchestrator",
}
PROJECT_SERVICES = ("migrate", "schedules", "triggers", "worker", "beat", "flower", "serve")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    services = compose["services"]
    assert isinstance(services, dict)
    return services


#: what the tests pretend the shell running ``docker compose`` has set
COMPOSE_ENV = {"FLOWER_PASSWORD": "s3cret", "ORCHESTRATOR_UI_AUTH": "admin:s3cret-passw0rd"}
VARIABLE = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|:\?)(?P<arg>[^}]*))?\}")


class MissingVariableError(Exception):
    """A required ``${VAR:?message}`` is unset: compose refuses the whole file."""


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable interpolation for ``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}``."""

    def sub(m: re.Match[str]) -> str:
        value = env.get(m["name"], "")
        if value:
            return value
        if m["op"] == ":-":
            return m["arg"]
        if m["op"] == ":?":
            raise MissingVariableError(f"{m['name']}: {m['arg']}")
        return ""

    return VARIABLE.sub(sub, text)


def argv(service: dict[str, Any], env: dict[str, str] = COMPOSE_ENV) -> list[str]:
    """The service's command as compose runs it: interpolated, then split like a shell."""
    command = service["command"]
    if isinstance(command, str):
        return shlex.split(interpolate(command, env))
    return [interpolate(str(c), env) for c in command]


def depends(service: dict[str, Any], on: str) -> str | None:
    """The condition under which ``service`` waits for ``on``, or ``None``."""
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return "service_started" if on in deps else None
    entry = deps.get(on)
    return None if entry is None else entry.get("condition", "service_started")


def test_services_exist(services: dict[str, Any]) -> None:
    assert {"postgres", "redis", "migrate", "worker", "beat", "flower", "serve"} <= set(services)


def test_postgres(services: dict[str, Any]) -> None:
    pg = services["postgres"]
    assert pg["image"] == "postgres:16"
    assert "pg_isready" in " ".join(pg["healthcheck"]["test"])
    assert any(v.endswith(":/var/lib/postgresql/data") for v in pg["volumes"])


def test_redis_is_durable_and_never_evicts(services: dict[str, Any]) -> None:
    redis = services["redis"]
    assert redis["image"] == "redis:7"
    args = argv(redis)
    assert args[0] == "redis-server"
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert "healthcheck" in redis


def test_project_services_share_the_environment(services: dict[str, Any]) -> None:
    for name in PROJECT_SERVICES:
        service = services[name]
        assert service["build"] == ".", name
        env = service["environment"]
        assert isinstance(env, dict), f"{name}: environment should be the x-orchestrator-env mapping"
        for key, value in EXPECTED_ENV.items():
            if name == "migrate" and key == "ORCHESTRATOR_DATABASE_URL":
                value = DIRECT_URL  # migrations go straight to Postgres
            assert env.get(key) == value, f"{name}: {key}"


def test_every_process_goes_through_pgbouncer_in_transaction_mode(services: dict[str, Any]) -> None:
    bouncer = services["pgbouncer"]
    env = bouncer["environment"]
    assert env["POOL_MODE"] == "transaction" and depends(bouncer, "postgres") == "service_healthy"
    target = sa.engine.make_url(env["DATABASE_URL"])
    assert (target.host, target.port, target.database) == ("postgres", 5432, "orchestrator")
    port = int(env["LISTEN_PORT"])
    for name in PROJECT_SERVICES:
        settings = service_settings(services[name])
        url = sa.engine.make_url(settings.database_url)
        if name == "migrate":
            assert (url.host, url.port) == ("postgres", 5432)
            continue
        assert (url.host, url.port) == ("pgbouncer", port), name
        assert settings.db_transaction_pooler, name
        assert sa.engine.make_url(settings.db_direct_url).host == "postgres", name  # the duty lock
        if name not in {"flower"}:
            assert depends(services[name], "pgbouncer") == "service_healthy", name


def test_env_anchor(compose: dict[str, Any]) -> None:
    assert compose["x-orchestrator-env"] == EXPECTED_ENV


def test_migrate_is_one_shot_after_postgres(services: dict[str, Any]) -> None:
    migrate = services["migrate"]
    assert argv(migrate) == ["orchestrator", "db", "upgrade"]
    assert depends(migrate, "postgres") == "service_healthy"
    assert str(migrate.get("restart", "no")) == "no"


@pytest.mark.parametrize("name", ["worker", "beat"])
def test_worker_and_beat_wait_for_migration_and_redis(services: dict[str, Any], name: str) -> None:
    service = services[name]
    assert depends(service, "migrate") == "service_completed_successfully"
    assert depends(service, "redis") == "service_healthy"


def test_worker_and_beat_commands(services: dict[str, Any]) -> None:
    assert argv(services["worker"])[:2] == ["orchestrator", "worker"]
    assert "-c" in argv(services["worker"])
    assert argv(services["beat"])[:2] == ["orchestrator", "beat"]


def service_settings(service: dict[str, Any]) -> Settings:
    """The orchestrator settings a service's container reads from its environment."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return Settings.from_env({k: interpolate(str(v), COMPOSE_ENV) for k, v in env.items()})


def test_something_reconciles_without_beat(services: dict[str, Any]) -> None:
    # the reconciler runs in the workers' main processes, or as `orchestrator reconcile`
    in_workers = service_settings(services["worker"]).worker_reconciler
    standalone = [name for name, tokens in orchestrator_commands(services) if tokens[:1] == ["reconcile"]]
    assert in_workers or standalone, "no service runs the reconciler: retries and recovery would stop"


def test_beat_carries_no_reconciler_duty(tmp_path: Path) -> None:
    # beat fires the database's schedules; Celery's own beat_schedule stays empty
    from orchestrator.runtime.celery_app import create_app

    app = create_app(Settings.from_env({}, data_dir=str(tmp_path)), main="compose-check")
    assert dict(app.conf.beat_schedule) == {}


def test_beat_uses_the_database_scheduler_and_the_schedules_file_applies(
    services: dict[str, Any], tmp_path: Path, pg_clean: str
) -> None:
    from orchestrator import Orchestrator
    from orchestrator.runtime.celery_app import create_app

    args = argv(services["beat"])
    assert "-S" not in args and not [a for a in args if a.startswith("--scheduler")]  # the default: the database's
    assert depends(services["beat"], "schedules") == "service_completed_successfully"
    apply = argv(services["schedules"])
    assert apply[:3] == ["orchestrator", "schedule", "apply"]
    path = ROOT / apply[3]
    assert path.is_file()
    settings = Settings.from_env({}, data_dir=str(tmp_path), database_url=pg_clean)
    orc = Orchestrator(settings, app=create_app(settings, main="compose-schedules"))
    try:
        applied = orc.schedules.apply(path)
        assert [s.name for s in applied] == ["nightly-demo-etl"]
        assert applied[0].timing.tz == "America/New_York" and applied[0].factory == "tasks.dags:daily_etl"
        dag = orc.schedules.build(applied[0], applied[0].next_at)
        orc.check(dag)  # what it would submit is valid
    finally:
        orc.store.dispose()


def test_flower_requires_basic_auth_from_the_environment(services: dict[str, Any]) -> None:
    flower = services["flower"]
    args = argv(flower)
    assert args[:4] == ["celery", "-A", "config.celery_app", "flower"]
    assert "--port=5555" in args
    # credentials never on the command line (visible in ps): Flower reads FLOWER_BASIC_AUTH
    assert not [a for a in args if "auth" in a or "s3cret" in a], args
    env = flower["environment"]
    assert interpolate(env["FLOWER_BASIC_AUTH"], COMPOSE_ENV) == "admin:s3cret"
    assert interpolate(env["FLOWER_BASIC_AUTH"], {"FLOWER_USER": "alice", "FLOWER_PASSWORD": "pw"}) == "alice:pw"
    # no password, no Flower: compose refuses to start rather than expose it without auth
    with pytest.raises(MissingVariableError, match="FLOWER_PASSWORD"):
        interpolate(env["FLOWER_BASIC_AUTH"], {})
    # the orchestrator's settings are there too (the merge key kept them)
    assert env["ORCHESTRATOR_BROKER_URL"].startswith("redis://")
    # published on the host's loopback only
    assert flower["ports"] == ["127.0.0.1:5555:5555"]


def test_flower_reads_every_option_it_is_given(services: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # Flower silently drops what it does not know: an argument or a FLOWER_* variable with a typo
    # (FLOWER_BASICAUTH) would start it without authentication, so each must be one of its options
    import flower.options  # noqa: F401 - defines Flower's options on tornado's global options
    from flower.command import apply_env_options, is_flower_envvar, is_flower_option
    from tornado.options import options

    service = services["flower"]
    flower_args = argv(service)[4:]
    assert flower_args and all(a.startswith("--") and is_flower_option(a) for a in flower_args), flower_args
    names = [k for k in service["environment"] if k.startswith("FLOWER_")]
    assert names == ["FLOWER_BASIC_AUTH"]
    assert all(is_flower_envvar(n) for n in names)
    # the API is never opened without credentials, and no password is written in the file
    assert "FLOWER_UNAUTHENTICATED_API" not in service["environment"]
    text = COMPOSE.read_text(encoding="utf-8")
    assert not re.search(r"\$\{FLOWER_PASSWORD:?-", text), "FLOWER_PASSWORD must have no default"
    assert not [name for name, svc in services.items() if "FLOWER_PASSWORD" in (svc.get("environment") or {})]
    assert "FLOWER_PASSWORD:?" in text
    # an empty password counts as unset: compose refuses it too
    with pytest.raises(MissingVariableError, match="FLOWER_PASSWORD"):
        interpolate(service["environment"]["FLOWER_BASIC_AUTH"], {"FLOWER_USER": "admin", "FLOWER_PASSWORD": ""})
    # and Flower itself turns the variable into its basic_auth option, one user:password pair
    value = interpolate(service["environment"]["FLOWER_BASIC_AUTH"], COMPOSE_ENV)
    for name in list(os.environ):
        if name.startswith("FLOWER_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("FLOWER_BASIC_AUTH", value)
    saved = options.basic_auth
    try:
        apply_env_options()
        assert options.basic_auth == ["admin:s3cret"]
    finally:
        options.basic_auth = saved


def orchestrator_commands(services: dict[str, Any]) -> list[tuple[str, list[str]]]:
    found = [(name, argv(s)) for name, s in services.items() if "command" in s]
    return [(name, args[1:]) for name, args in found if args and args[0] == "orchestrator"]


def test_every_orchestrator_command_is_a_real_subcommand(services: dict[str, Any]) -> None:
    commands = orchestrator_commands(services)
    assert {name for name, _ in commands} >= {"migrate", "worker", "beat"}
    for service, tokens in commands:
        cmd: click.Command = main
        ctx = click.Context(main, info_name="orchestrator")
        rest = list(tokens)
        path = ["orchestrator"]
        while isinstance(cmd, click.Group):
            assert rest, f"{service}: `{' '.join(path)}` needs a subcommand"
            name = rest.pop(0)
            sub = cmd.get_command(ctx, name)
            assert sub is not None, f"{service}: `{' '.join(path)}` has no subcommand {name!r}"
            path.append(name)
            cmd = sub
            ctx = click.Context(cmd, info_name=name, parent=ctx)
        # parse (without invoking) the remaining arguments: unknown options fail here,
        # unless the command forwards them to Celery (worker, beat)
        cmd.make_context(path[-1], rest, parent=ctx.parent)


def test_db_group_commands() -> None:
    assert "db" in main.commands
    db = main.commands["db"]
    assert isinstance(db, click.Group)
    assert {"upgrade", "downgrade", "current"} <= set(db.commands)


def test_every_celery_app_module_is_importable_with_an_app(services: dict[str, Any], tmp_path: Path) -> None:
    modules = set()
    for _name, service in services.items():
        if "command" not in service:
            continue
        args = argv(service)
        if args[0] != "celery":
            continue
        for flag in ("-A", "--app"):
            if flag in args:
                modules.add(args[args.index(flag) + 1])
        modules.update(a.split("=", 1)[1] for a in args if a.startswith("--app="))
    assert modules == {"config.celery_app"}
    # in a fresh interpreter, so that this test does not build the process-wide app early
    env = {**os.environ, "ORCHESTRATOR_DATA_DIR": str(tmp_path)}
    for module in modules:
        code = (
            "import importlib, celery\n"
            f"m = importlib.import_module({module!r})\n"
            "assert isinstance(m.app, celery.Celery), type(m.app)\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr


def test_dockerfile_installs_the_project() -> None:
    assert DOCKERFILE.is_file()
    text = DOCKERFILE.read_text(encoding="utf-8")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    assert re.search(r"\bpip install \.(\s|$)", text), "the Dockerfile must `pip install .`"
    # everything the package build needs is copied, and every copied path exists
    copied: list[str] = []
    for line in lines:
        if line.startswith("COPY "):
            copied.extend(shlex.split(line)[1:-1])
    for path in copied:
        assert (ROOT / path).exists(), f"COPY {path}: no such file in the project"
    for needed in ("pyproject.toml", "README.md", "orchestrator", "tasks", "config"):
        assert needed in copied or "." in copied, f"the Dockerfile does not copy {needed}"
    cmd = [line for line in lines if line.startswith("CMD")]
    assert cmd, "the Dockerfile has no CMD"
    assert cmd[-1] in ('CMD ["orchestrator", "worker"]', "CMD orchestrator worker")


def test_serve_requires_credentials_and_publishes_on_loopback(services: dict[str, Any]) -> None:
    from orchestrator.core.errors import ConfigurationError
    from orchestrator.web.auth import Access

    serve = services["serve"]
    args = argv(serve)
    assert args[:2] == ["orchestrator", "serve"]
    host = args[args.index("--host") + 1]
    # bound to every interface in its container: it starts only because credentials are required
    with pytest.raises(MissingVariableError):
        argv({"command": serve["environment"]["ORCHESTRATOR_UI_AUTH"]}, env={})
    settings = service_settings(serve)
    access = Access(settings.ui_auth, host)
    assert access.credentials and not access.generated and not access.local
    with pytest.raises(ConfigurationError, match="ORCHESTRATOR_UI_AUTH"):
        Access("", host)  # without them, serve would refuse to start there
    assert all(str(p).startswith("127.0.0.1:") for p in serve["ports"])
    assert depends(serve, "migrate") == "service_completed_successfully"


def test_the_triggers_service_applies_the_triggers_file(services: dict[str, Any]) -> None:
    assert argv(services["triggers"]) == ["orchestrator", "on", "apply", "config/triggers.yaml"]
    assert depends(services["triggers"], "migrate") == "service_completed_successfully"


def test_the_triggers_file_applies(tmp_path: Path, pg_clean: str) -> None:
    """``config/triggers.yaml`` (``orchestrator on apply``) is valid, and an event it matches
    starts a run that would submit."""
    from orchestrator import Orchestrator
    from orchestrator.runtime.celery_app import create_app

    settings = Settings.from_env({}, data_dir=str(tmp_path), database_url=pg_clean)
    orc = Orchestrator(settings, app=create_app(settings, main="compose-triggers"))
    try:
        applied = orc.triggers.apply(ROOT / "config" / "triggers.yaml")
        assert [(t.name, t.event, t.factory) for t in applied] == [
            ("demo-etl-on-landing", "data.landed", "tasks.dags:daily_etl")
        ]
        dag, _ = orc.triggers.build(applied[0], dt.datetime.now(dt.UTC), {"source": "demo", "tz": "Europe/Paris"})
        orc.check(dag)
    finally:
        orc.store.dispose()
