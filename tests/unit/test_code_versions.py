"""Code versions without a database: the version pattern, pinned queue names, the hash of task
modules, the setting, and a worker's pinned queues added to what its Celery app consumes."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator import Settings
from orchestrator.core.errors import ConfigurationError, ValidationError
from orchestrator.core.workers import (
    HASH_CHARS,
    check_code_version,
    modules_hash,
    pinned_queue,
    pinned_queues,
    pinned_text,
    split_pinned,
)
from orchestrator.runtime.celery_app import create_app
from orchestrator.runtime.registration import add_pinned_queues, code_version, task_sources


@pytest.mark.parametrize("good", ["v1", "1", "build.2026-05-01+abc_7", "A" * 64])
def test_good_code_versions(good: str) -> None:
    assert check_code_version(good) == good


@pytest.mark.parametrize("bad", ["", "-v1", ".v1", "v 1", "v1@x", "v/1", "é", "A" * 65, None, 1])
def test_bad_code_versions_are_refused(bad: object) -> None:
    with pytest.raises(ValidationError, match="code_version must be 1-64 letters"):
        check_code_version(bad)


def test_pinned_queue_names() -> None:
    assert pinned_queue("orchestrator.default", "v2") == "orchestrator.default@v2"
    assert split_pinned("orchestrator.default@v2") == ("orchestrator.default", "v2")
    assert split_pinned("orchestrator.default") == ("orchestrator.default", None)
    assert split_pinned("q@") == ("q@", None) and split_pinned("@v1") == ("@v1", None)
    # a worker pins each queue it consumes, not an already pinned one or another name with an @
    assert pinned_queues(["b", "a", "a@v1", "w@host.dq2", "q" * 198], "v1") == ["a@v1", "b@v1"]
    assert pinned_text("q", "v2", "t", {"b": None, "a": "v1"}) == (
        "no live worker of code version v2 on queue q has task t registered (workers on q: a (version v1),"
        " b (no version))"
    )


def test_the_hash_of_task_modules_is_stable_and_follows_every_byte() -> None:
    sources = {"tasks.b": b"def b(): ...\n", "tasks.a": b"def a(): ...\n"}
    version = modules_hash(sources)
    assert len(version) == HASH_CHARS and int(version, 16) >= 0
    assert modules_hash(dict(reversed(list(sources.items())))) == version  # the order they came in
    assert modules_hash({**sources, "tasks.a": b"def a(): return 1\n"}) != version
    assert modules_hash({"tasks.c": sources["tasks.a"], "tasks.b": sources["tasks.b"]}) != version  # a renamed module
    assert check_code_version(version) == version


def test_the_setting_is_checked() -> None:
    assert Settings.from_env({"ORCHESTRATOR_CODE_VERSION": "v7"}).code_version == "v7"
    assert Settings.from_env({}).code_version == ""
    with pytest.raises(ConfigurationError, match="ORCHESTRATOR_CODE_VERSION must be 1-64 letters"):
        Settings.from_env({"ORCHESTRATOR_CODE_VERSION": "v 7"})


def test_a_worker_advertises_its_setting_or_the_hash_of_its_task_modules(tmp_path: Path) -> None:
    settings = Settings.from_env({}, data_dir=str(tmp_path), task_modules=("tasks.probes", "tasks.etl"))
    app = create_app(settings)
    sources = task_sources(app)
    # the modules of its registered tasks (in this process also those every app shares: Celery's
    # @app.task registers a task on each app, the other task modules the tests imported included)
    assert {"tasks.etl", "tasks.probes"} <= set(sources)
    root = Path(__file__).resolve().parents[2]
    assert sources["tasks.etl"] == (root / "tasks" / "etl.py").read_bytes()
    assert code_version(app) == modules_hash(sources)
    pinned = create_app(Settings.from_env({"ORCHESTRATOR_CODE_VERSION": "v3"}, data_dir=str(tmp_path)))
    assert code_version(pinned) == "v3"


def test_a_worker_consumes_the_pinned_queues_of_its_queues_declared_like_them(tmp_path: Path) -> None:
    app = create_app(Settings.from_env({}, data_dir=str(tmp_path)))
    app.amqp.queues.select(["orchestrator.default", "custom"])  # -Q orchestrator.default,custom
    assert add_pinned_queues(app, "v2") == ["custom@v2", "orchestrator.default@v2"]
    consumed = app.amqp.queues.consume_from
    assert sorted(consumed) == ["custom", "custom@v2", "orchestrator.default", "orchestrator.default@v2"]
    plain, pinned = consumed["orchestrator.default"], consumed["orchestrator.default@v2"]
    assert (pinned.exchange.name, pinned.exchange.type, pinned.routing_key) == (
        "orchestrator.default@v2",
        "direct",
        pinned.name,
    )
    assert pinned.exchange.type == plain.exchange.type and pinned.queue_arguments == plain.queue_arguments
    # the publisher finds the same declaration under the pinned name
    assert app.amqp.queues["orchestrator.default@v2"] is pinned
